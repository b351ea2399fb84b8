"""Token in, token out. An episode keeps the policy's tokens and appends what the chat template renders
for the environment's messages: built turn by turn it equals the whole conversation rendered once (for
turns written as the template renders them), on the Qwen3, Llama-3.x and DeepSeek-V3 templates; templates
that rewrite earlier turns (Qwen3 with user turns after reasoning, DeepSeek-R1) are refused. On the
engine: tool episodes train with diff = 0 on every policy token, environment tokens outside the mask.
Control: re-tokenising the conversation's text changes tokens the policy sampled."""
import pytest
import torch

from onepath.chat.encoder import ChatEncoder
from onepath.chat.template import ChatTemplate, ChatTemplateError, special_tokens
from onepath.chat.tools import Toolbox, calculator
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.numerics.diff import is_exact, rollout_diff
from onepath.train.actor import Actor
from onepath.train.episodes import Episode, episode_metrics, episode_responses, masked_logprobs, run_episodes
from onepath.train.tool_env import ChatEnv, ToolEnv
from tests.chat_families import FAMILIES, char_tokenizer, tokenizer, tokenizer_config
from tests.tiny import tiny_model


def encoder(family, tok=None, tools=None, **kwargs):
    config = tokenizer_config(family)
    template = ChatTemplate({"default": config["chat_template"]}, family, special_tokens(config))
    tok = tok or tokenizer(family)
    return ChatEncoder(template, tok, tools=tools, stop_token_ids=(tok.token_to_id(FAMILIES[family]["eos"]),),
                       **kwargs)


CALL = {"qwen3": '<think>\nI should add.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
                 '{"expression": "2+3"}}\n</tool_call>',
        "llama3.1": '{"name": "calculator", "parameters": {"expression": "2+3"}}',
        "llama3.2": '{"name": "calculator", "parameters": {"expression": "2+3"}}',
        "deepseek_v3": 'Adding.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n'
                       '{"expression": "2+3"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'}


def tool_conversation(family):
    """Two tool rounds (the second with two results), then an answer: each turn as the model writes it."""
    calls = {"role": "assistant", "content": CALL[family]}
    result = lambda c, i: {"role": "tool", "name": "calculator", "tool_call_id": f"call_{i}", "content": c}
    return [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2+3, twice?"},
            calls, result("5", 0), calls, result("5", 1), result("error: no tool named 'x'", 2),
            {"role": "assistant", "content": "<think>\nBoth 5.\n</think>\n\n5 and 5." if family == "qwen3" else "5"}]


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "llama3.2", "deepseek_v3"])
def test_tool_episode_built_turn_by_turn_is_the_conversation_rendered_once(family):
    chat = encoder(family, tools=[calculator])
    chat.check_episodes(("tool",))
    assert chat.episode_problem(tool_conversation(family)) is None


@pytest.mark.parametrize("family", ["llama3", "llama3.1", "deepseek_v3"])
def test_user_turn_episodes_too(family):
    chat = encoder(family)
    chat.check_episodes(("user",))
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                    {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes."}]
    assert chat.episode_problem(conversation) is None


@pytest.mark.parametrize("family, kwargs, roles, match", [
    ("qwen3", {}, ("user",), r"at token \d+ the episode reads .*<think>"),                  # earlier reasoning stripped
    ("qwen3", {"enable_thinking": False}, ("tool",), r"not after its generation prompt"),   # the empty think block
    ("deepseek_r1", {}, ("tool",), r"not after its generation prompt .*<think>"),           # reasoning stripped
])
def test_templates_that_rewrite_earlier_turns_are_refused(family, kwargs, roles, match):
    chat = encoder(family, **kwargs)
    with pytest.raises(ChatTemplateError, match=rf"cannot keep episodes token in, token out .*{match}"):
        chat.check_episodes(roles)


def test_append_ids_refuses_a_rewritten_history():
    """Qwen3 drops the reasoning of every turn before the last user query: a user turn after two assistant
    turns rewrites the first."""
    chat = encoder("qwen3")
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>\nr\n</think>\n\na"},
               {"role": "tool", "content": "5"}, {"role": "assistant", "content": "<think>\ns\n</think>\n\nb"}]
    assert chat.append_ids(history, [{"role": "tool", "content": "6"}])
    with pytest.raises(ChatTemplateError, match="rewrites an earlier turn .*<think>"):
        chat.append_ids(history, [{"role": "user", "content": "q2"}])


def test_the_policys_sampled_tokens_stay_as_sampled_unlike_retokenising():
    """The drift TRL and verl users report: a policy may sample a word in pieces BPE would merge; re-encoding
    the conversation's text merges them, the episode does not."""
    tok = tokenizer("qwen3")
    chat = encoder("qwen3", tok, tools=[calculator])
    messages = [{"role": "user", "content": "Weather?"}]
    word = tok.encode("weather", add_special_tokens=False).ids
    assert len(word) == 1   # a merged token: the pieces below are a non-canonical spelling of it
    pieces = [t for ch in "weather" for t in tok.encode(ch, add_special_tokens=False).ids]
    turn = pieces + [chat.end_of_turn_id]
    episode = Episode.start(0, chat.prompt_ids(messages), messages)
    episode.append_policy(turn, [0.0] * len(turn), "stop")
    env = ToolEnv(chat, Toolbox([calculator]))
    assert env.step(episode)[0] is None     # no call: the final answer
    assert episode.completion_ids == turn   # the sampled pieces, kept
    retokenised = chat.conversation_ids(episode.messages)[len(episode.prompt_ids):]
    assert word[0] in retokenised and retokenised[:len(turn)] != turn


def tool_env_step(chat, env, episode, text, finish="stop"):
    ids = chat.encode(text) + ([chat.end_of_turn_id] if finish == "stop" else [])
    episode.append_policy(ids, [0.0] * len(ids), finish)
    return env.step(episode)


def test_tool_env_runs_calls_and_answers_failures_as_tool_messages():
    chat = encoder("qwen3", tools=[calculator])
    env = ToolEnv(chat, Toolbox([calculator]))
    assert env.tool_format == "hermes"
    messages = [{"role": "user", "content": "2+3?"}]
    episode = Episode.start(7, chat.prompt_ids(messages), messages)
    tokens, info = tool_env_step(chat, env, episode, CALL["qwen3"])
    text = chat.tokenizer.decode(tokens, skip_special_tokens=False)
    assert text == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert info == {"answer": "<think>\nI should add.\n</think>", "tool_calls": 1, "tool_errors": 0}
    episode.append_env(tokens)
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>\n<tool_call>\n{"nam'
    tokens, info = tool_env_step(chat, env, episode, bad)
    answers = [m["content"] for m in episode.messages[-2:]]
    assert answers[0].startswith("error: calculator raised ArithmeticError: 1/0 is not an exact integer division")
    assert answers[1].startswith("error: malformed tool call: <tool_call> without </tool_call>")
    assert info["tool_calls"] == 3 and info["tool_errors"] == 2
    episode.append_env(tokens)
    # a turn cut at max_tokens: the environment writes the end-of-turn token the policy did not
    tokens, _ = tool_env_step(chat, env, episode, '<tool_call>\n{"name": "calculator", "arguments": {"expression": '
                                                  '"7"}}\n</tool_call>', finish="length")
    assert tokens[0] == chat.end_of_turn_id
    episode.append_env(tokens)
    tokens, info = tool_env_step(chat, env, episode, "The answer is 5.")
    assert tokens is None and info["answer"] == "The answer is 5."
    # the episode is the conversation rendered once, up to the final turn (Qwen3 renders the last turn with an
    # empty think block this policy never wrote: the documented place where they may differ)
    last = max(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
    head = chat.prompt_ids(episode.messages[:last])
    assert episode.token_ids[:len(head)] == head


class FollowUp(ChatEnv):
    """A user who says "Go on." after every turn: the environment of user turns."""
    roles = ("user",)

    def reply(self, episode, text):
        return [{"role": "user", "content": "Go on."}], {"answer": text}


def chat_model(tok, mode, eos):
    return tiny_model(mode, seed=3, vocab_size=tok.get_vocab_size(), eos_token_id=eos, max_positions=1024,
                      max_position_embeddings=1024)


def chat_engine(tok, mode, eos):
    model = chat_model(tok, mode, eos)
    return LLMEngine(model, num_blocks=1024, block_size=16, scheduler=SchedulerConfig(max_model_len=1024)), model


def prompts_of(chat, n):
    return [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+{i}?"}]
            for i in range(n)]


def test_engine_user_turn_episodes_are_the_conversation_rendered_once_and_diff_zero():
    tok = char_tokenizer("deepseek_v3")   # tokens decode and encode back to themselves
    eos = tok.token_to_id(FAMILIES["deepseek_v3"]["eos"])
    chat = encoder("deepseek_v3", tok)
    engine, _ = chat_engine(tok, "consistent", eos)
    conversations = prompts_of(chat, 6)
    params = SamplingParams(max_tokens=10, seed=3, stop_token_ids=(chat.end_of_turn_id,))
    episodes = run_episodes(engine, [chat.prompt_ids(c) for c in conversations], FollowUp(chat), params, 3,
                            conversations=conversations)
    assert all(e.turns == 3 for e in episodes)
    for e in episodes:
        messages = e.messages[:max(i for i, m in enumerate(e.messages) if m["role"] == "assistant") + 1]
        whole = chat.conversation_ids(messages)
        assert whole[:len(e)] == e.token_ids, "the episode is not the conversation rendered once"
        assert chat.tokenizer.decode(whole[len(e):], skip_special_tokens=False) in ("", "<｜end▁of▁sentence｜>")
    r = episode_responses(episodes, params)
    lp, _ = masked_logprobs(Actor(chat_model(tok, "consistent", eos), block_size=16, lr=1e-3), r)
    assert is_exact(rollout_diff(r.rollout_logprobs, lp.detach(), r.mask))


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_engine_tool_episodes_diff_zero_and_env_tokens_masked(mode):
    tok = char_tokenizer("qwen3")
    eos = tok.token_to_id(FAMILIES["qwen3"]["eos"])
    chat = encoder("qwen3", tok, tools=[calculator])
    engine, _ = chat_engine(tok, mode, eos)
    conversations = prompts_of(chat, 16)
    params = SamplingParams(max_tokens=12, seed=5, top_p=0.95)
    episodes = run_episodes(engine, [chat.prompt_ids(c) for c in conversations], ToolEnv(chat, Toolbox([calculator])),
                            params, 3, conversations=conversations)
    metrics = episode_metrics(episodes)
    assert metrics["episode/turns/mean"] > 1 and metrics["episode/tool_errors/mean"] > 0   # the episode goes on
    r = episode_responses(episodes, params)
    actor = Actor(chat_model(tok, mode, eos), block_size=16, lr=1e-3)
    lp, _ = masked_logprobs(actor, r)
    diff = rollout_diff(r.rollout_logprobs, lp.detach(), r.mask)
    if mode == "consistent":
        assert is_exact(diff) and diff["rollout_corr/valid_tokens"] > 100
    else:   # control: the stock kernels' trainer differs from their engine
        assert diff["rollout_corr/tokens_differing_frac"] > 0
    for e in episodes:
        for (_, end), (start, _) in zip(e.segments, e.segments[1:]):
            env = e.token_ids[end:start]
            assert not any(e.policy_mask[end:start]) and chat.tokenizer.decode(env, skip_special_tokens=False) \
                .endswith("<|im_end|>\n<|im_start|>assistant\n") and "<tool_response>" in \
                chat.tokenizer.decode(env, skip_special_tokens=False)
        assert torch.equal(torch.tensor(e.policy_mask[e.num_prompt_tokens:]),
                           r.mask[episodes.index(e), :len(e) - e.num_prompt_tokens])
