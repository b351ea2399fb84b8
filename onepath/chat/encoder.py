"""Conversations as token ids, token in and token out.

A prompt is its messages rendered with add_generation_prompt and encoded once (no special tokens added:
the template writes its own BOS, as transformers' apply_chat_template tokenises). An episode then only
grows: the policy's tokens are kept as sampled, and what an environment adds (tool results, user turns)
is rendered by the template in its place and appended as tokens. Nothing is re-tokenised from text.

append_ids renders the conversation without the latest turn (H) and with the new messages and a
generation prompt (A). A must begin with H: the template may render the latest turn as it likes (its
tokens are the policy's own), but never rewrite an earlier one. The new tokens are A's text after the
latest turn's end-of-turn token (from that token on, when the policy was cut off before writing it),
encoded where that token boundary splits the text, checked against encoding the turn and the new
messages as one.

Episode = template rendering: a policy that writes exactly what the template renders for its turns
gets an episode whose tokens equal encoding the whole conversation rendered once. check_episodes
proves that on a probe conversation at start, and refuses a template that rewrites earlier turns once
more messages come (one that strips earlier reasoning, or a generation prompt the history drops).
Otherwise they may differ, and the episode keeps what the policy saw: a turn the template would
format otherwise (JSON spacing, trimmed whitespace, reasoning a template omits), a non-canonical
tokenisation the policy sampled, or bytes that do not decode. docs/chat.md.
"""
from __future__ import annotations

from tokenizers import Tokenizer

from onepath.chat.template import ChatTemplate, ChatTemplateError

PROBE = "ONEPATH_PROBE"


class ChatEncoder:
    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer, tools: list | None = None,
                 stop_token_ids: tuple[int, ...] = (), **template_kwargs):
        """tools: the tools the template describes (functions, chat.tools.Tool or schemas); stop_token_ids:
        the tokens that end a policy turn besides the template's end-of-turn (the model's EOS)."""
        self.template, self.tokenizer = template.check(), tokenizer
        self.tools, self.kwargs = tools, template_kwargs
        self.added = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.end_of_turn_id = self.added[self.end_of_turn_text()]
        self.stop_ids = tuple(dict.fromkeys((self.end_of_turn_id, *stop_token_ids)))
        texts = [tokenizer.id_to_token(i) for i in self.stop_ids]
        self.stop_texts = tuple(t for t in texts if t in self.added)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
                                    **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def conversation_ids(self, messages: list[dict]) -> list[int]:
        """The whole conversation rendered once and encoded: what an episode is compared with."""
        return self.encode(self.render(messages))

    def turn_text(self, ids: list[int]) -> str:
        """A policy turn as a message's content: its tokens decoded as written, the stop token left out."""
        ids = ids[:-1] if ids and ids[-1] in self.stop_ids else ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def end_of_turn_text(self) -> str:
        """The token the template closes an assistant turn with (<|im_end|>, <|eot_id|>, ...)."""
        text = self.template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": PROBE}],
                                    **self.kwargs)
        tail = text[text.rfind(PROBE) + len(PROBE):] if PROBE in text else ""
        found = [t for t in self.added if t and tail.startswith(t)]
        if not found:
            raise ChatTemplateError(f"chat template {self.template.source}: an assistant turn is followed by "
                                    f"{tail[:40]!r}, which does not start with a special token of the tokenizer: "
                                    "onepath cannot tell where a turn ends")
        return max(found, key=len)

    def append_ids(self, history: list[dict], new: list[dict], ended: bool = True) -> list[int]:
        """The tokens that follow the policy's latest turn (history[-1]) to add `new` and open the next
        turn. ended: the turn ended with a stop token (else the template's end-of-turn is added too)."""
        before = self.render(history[:-1]) if len(history) > 1 else ""
        after = self.render(history + new, add_generation_prompt=True)
        if not after.startswith(before):
            at = next(i for i, (a, b) in enumerate(zip(before, after + "\0")) if a != b)
            raise ChatTemplateError(
                f"chat template {self.template.source} rewrites an earlier turn when messages are added (at "
                f"character {at}: {before[max(0, at - 30):at + 30]!r} becomes {after[max(0, at - 30):at + 30]!r}): "
                "the episode's tokens would no longer be the conversation; give a template that keeps earlier "
                "turns as they were (data.chat_template PATH)")
        turn = after[len(before):]
        closes = [(turn.find(t), t) for t in self.stop_texts if t in turn]
        if not closes:
            raise ChatTemplateError(f"chat template {self.template.source} renders the assistant's turn without an "
                                    f"end-of-turn token ({', '.join(self.stop_texts)}): {turn[:80]!r}")
        at, close = min(closes)
        start = at + len(close) if ended else at
        # the new text starts at a special token's edge, where the tokenizer splits: checked, not assumed
        whole, head = self.encode(turn), self.encode(turn[:start])
        if whole[:len(head)] != head:
            raise ChatTemplateError(f"chat template {self.template.source}: the tokens of {turn[start:start + 40]!r} "
                                    "merge with the turn before them; onepath cannot append them as tokens")
        return whole[len(head):]

    def check_episodes(self, roles: tuple[str, ...] = ("tool",)) -> None:
        """Refuse, with the first difference, a template under which a policy writing exactly what the
        template renders would get episodes other than the conversation rendered once, when the
        environment adds messages of these roles. Tried with and without reasoning in the assistant turns;
        one of them must hold."""
        problems = []
        for reasoning in (True, False):
            problem = self.episode_problem(probe_conversation(roles, reasoning))
            if problem is None:
                return
            problems.append(f"{'with' if reasoning else 'without'} reasoning, {problem}")
        raise ChatTemplateError(f"chat template {self.template.source} cannot keep episodes token in, token out "
                                f"with {'/'.join(roles)} messages: {'; '.join(problems)}; give a template that "
                                "renders earlier turns as the model wrote them (data.chat_template PATH), docs/chat.md")

    def episode_problem(self, conversation: list[dict]) -> str | None:
        """None when building `conversation` as an episode (each assistant turn as the template renders it,
        the other messages appended by append_ids) gives the conversation's tokens rendered once."""
        assistants = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
        ids = self.prompt_ids(conversation[:assistants[0]])
        for n, k in enumerate(assistants):
            prompt = self.prompt_ids(conversation[:k])
            full = self.conversation_ids(conversation[:k + 1])
            if full[:len(prompt)] != prompt:
                return (f"an assistant turn renders as {self.render(conversation[:k + 1])[-60:]!r}, not after its "
                        f"generation prompt {self.render(conversation[:k], True)[-40:]!r}")
            turn = full[len(prompt):]
            ends = [j for j, t in enumerate(turn) if t in self.stop_ids]
            if not ends:
                return f"assistant turn {n} renders without an end-of-turn token"
            ids += turn[:ends[0] + 1]
            nxt = assistants[n + 1] if n + 1 < len(assistants) else len(conversation)
            if nxt > k + 1:
                ids += self.append_ids(conversation[:k + 1], conversation[k + 1:nxt])
        whole = self.conversation_ids(conversation)
        if whole[:len(ids)] != ids:
            at = next(i for i, (a, b) in enumerate(zip(ids, whole + [-1])) if a != b)
            show = lambda t: repr(self.tokenizer.decode(t[max(0, at - 12):at + 12], skip_special_tokens=False))
            return f"at token {at} the episode reads {show(ids)} where the conversation rendered once reads {show(whole)}"
        return None


def probe_conversation(roles: tuple[str, ...], reasoning: bool) -> list[dict]:
    """system, user, then three assistant turns with the environment's messages (of `roles`) between
    them. The turns are plain text, as an episode keeps a policy's turn (its tool calls inside it)."""
    conversation = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": "What is six times seven?"}]
    for turn in range(3):
        thought = f"<think>\nStep {turn}: think it over.\n</think>\n\n" if reasoning else ""
        conversation.append({"role": "assistant", "content": f"{thought}Answer {turn}."})
        if turn < 2:
            conversation += [{"role": "tool", "name": "probe", "tool_call_id": f"call_{turn}", "content": str(42 + turn)}
                             if role == "tool" else {"role": role, "content": f"And then {turn}?"} for role in roles]
    return conversation
