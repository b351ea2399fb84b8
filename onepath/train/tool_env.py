"""Chat environments for train/episodes.py: the policy's turn becomes an assistant message and the
environment answers with messages the chat template renders, appended as tokens (chat/encoder.py:
token in, token out; the turn itself is kept as sampled).

ToolEnv (rollout.env tools): the tool calls in a turn, in the format the template teaches
(chat/tool_calls.py), are run (chat/tools.py) and answered with tool messages; a turn without a call
is the final answer and ends the episode. A malformed call, an unknown tool, bad arguments or a tool's
exception is answered by a tool message that says so, and the episode goes on.

Episode.messages holds the conversation: the prompt's messages, then each turn as {"role": "assistant",
"content": its text as decoded} and the environment's answers (the last answer stays there when
run_episodes ends the episode before the next turn).
"""
from __future__ import annotations

from onepath.chat.encoder import ChatEncoder
from onepath.chat.tool_calls import detect_format, parse
from onepath.chat.tools import Toolbox, tool_message


class ChatEnv:
    """An Environment whose answers are chat messages. Subclasses write reply()."""
    roles: tuple[str, ...] = ("tool",)   # the roles of the messages it adds
    stop_token_ids: tuple[int, ...] = ()  # a turn ends at the template's end-of-turn token (the trainer adds it)

    def __init__(self, chat: ChatEncoder):
        chat.check_episodes(self.roles)   # refuses a template that would rewrite earlier turns
        self.chat = chat

    def step(self, episode) -> tuple[list[int] | None, dict]:
        if not episode.messages:
            raise ValueError(f"episode {episode.episode_id} has no messages: a chat environment continues a "
                             "conversation, so its prompts must be chat lists (run_episodes' conversations)")
        text = self.chat.turn_text(episode.last_segment)
        new, info = self.reply(episode, text)
        episode.messages.append({"role": "assistant", "content": text})
        if new is None:
            return None, info
        ended = episode.finish_reasons[-1] == "stop"   # else the turn hit max_tokens before its end token
        tokens = self.chat.append_ids(episode.messages, new, ended)
        episode.messages += new
        return tokens, info

    def reply(self, episode, text: str) -> tuple[list[dict] | None, dict]:
        """The messages answering the policy's turn `text` (None: the episode is done) and reward info."""
        raise NotImplementedError


class ToolEnv(ChatEnv):
    def __init__(self, chat: ChatEncoder, toolbox: Toolbox, tool_format: str = "auto"):
        if tool_format == "auto":
            tool_format = detect_format(chat.template.source_for(toolbox.schemas))
            if tool_format is None:
                raise ValueError(f"the chat template {chat.template.source} shows no tool-call format: set "
                                 "rollout.tool_format (hermes, llama3 or deepseek), or give a template with tools")
        self.toolbox, self.tool_format = toolbox, tool_format
        super().__init__(chat)

    def reply(self, episode, text: str) -> tuple[list[dict] | None, dict]:
        turn = parse(text, self.tool_format, id_prefix=f"call_{episode.turns - 1}")
        answers = [self.toolbox.call(c) for c in turn.calls] + [tool_message(None, f"error: {e}") for e in turn.errors]
        results = [m["content"] for m in episode.messages + answers if m["role"] == "tool"]
        info = {"answer": turn.content, "tool_calls": len(results),
                "tool_errors": sum(r.startswith("error:") for r in results)}
        return (answers or None), info
