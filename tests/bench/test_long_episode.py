"""The long-episode bench at a small size on the CPU: multi-turn tool episodes grown to --tokens through the
chat template, diff = 0 on every policy token before the GRPO update and after it (the baseline differs: the
control), memory and timings reported per micro-batch setting; the episode's mask holds the policy's tokens only;
an episode meets max_model_len by the engine's rule (a prompt at or past it is refused by name, a history that
would pass it ends with finish_reason "length"); a micro-batch setting that runs out of memory is reported and the
others still run."""
import json

import pytest
import torch

from onepath.bench import long_episode
from onepath.bench.workloads import model_config
from onepath.engine.sampling_params import SamplingParams
from onepath.train.actor import Actor
from onepath.train.episodes import run_episodes

SMALL = ["--device", "cpu", "--episodes", "2", "--tokens", "400", "--turn-tokens", "12", "--reply-tokens", "20"]


def test_long_episodes_keep_diff_zero_before_and_after_the_update(tmp_path):
    out = tmp_path / "long.json"
    assert long_episode.main(SMALL + ["--micro-batch-tokens", "400", "0", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["command"].startswith("python -m onepath.bench.long_episode --device cpu")
    consistent, baseline = record["modes"]["consistent"], record["modes"]["baseline"]
    for phase in ("before", "after"):
        d = consistent["diff"][phase]
        assert d["torch_equal"] and d["exact"] and d["rollout_corr/valid_tokens"] == d["policy_tokens"] > 60
        episodes = consistent["rollouts"][phase]["episodes"]
        # each grown to --tokens, short of it by less than a turn when the last turn stops early
        assert all(400 - 12 - 1 <= e["tokens"] <= 400 and e["turns"] >= 3 and e["finish_reason"] == "done"
                   for e in episodes)
        assert sum(e["policy_tokens"] for e in episodes) == d["policy_tokens"]
        assert consistent["rollouts"][phase]["seconds"] > 0 and consistent["rollouts"][phase]["peak_gib"] > 0
        cost = consistent["trainer_logprobs"][phase]
        assert cost["micro_batch_tokens"] == 400 and cost["seconds"] > 0 and cost["peak_growth_gib"] > 0
        # the control: the stock kernels' trainer and engine part ways on the same episodes
        assert baseline["diff"][phase]["rollout_corr/tokens_differing_frac"] > 0
    kv = consistent["kv"]
    assert kv["max_model_len"] == 400 and kv["episodes_that_fit"] >= 2 and kv["kv_cache_gib"] > 0
    trainer = consistent["trainer"]
    assert [(s["micro_batch_tokens"], s["recompute"], s["micro_batches"]) for s in trainer["settings"]] == [
        (400, True, 2), (0, True, 1), (400, False, 2)]
    for s in trainer["settings"]:
        assert s["peak_gib"] > 0 and s["peak_growth_gib"] > 0 and s["seconds"] > 0, s
        assert s["logprobs_equal_first_setting"], s
    assert trainer["weights_changed_frac"] > 0.5 and trainer["step_seconds"] > 0 and trainer["sync_seconds"] > 0


def test_environment_turns_are_outside_the_mask_and_max_model_len_bounds_an_episode():
    args = long_episode.options(SMALL)
    chat = long_episode.chat_encoder(model_config(args.model).vocab_size)
    env = long_episode.LogEnv(chat, args.tokens, args.turn_tokens, args.reply_tokens)
    engine = long_episode.build_engine(args, long_episode.build_model(args, "consistent"), chat)
    episodes, r, rows, _ = long_episode.rollout(engine, chat, env, args, 0, args.seed)
    for i, e in enumerate(episodes):
        assert rows[i]["tokens"] == len(e) <= args.tokens and e.turns == rows[i]["turns"] >= 3
        completion_mask = e.policy_mask[e.num_prompt_tokens:]
        assert r.mask[i, :len(completion_mask)].tolist() == completion_mask
        assert not r.mask[i, len(completion_mask):].any()
        assert sum(completion_mask) == sum(b - a for a, b in e.segments)
        results = [m["content"] for m in e.messages if m["role"] == "tool"]
        read = 0
        for (_, end), (start, _), result in zip(e.segments, e.segments[1:], results):
            text = chat.tokenizer.decode(e.token_ids[end:start], skip_special_tokens=False)
            assert not any(e.policy_mask[end:start])   # the tool's turn, rendered by the template, is not trained on
            assert result == long_episode.read_output(read, len(result))
            assert 0 < len(result) <= args.reply_tokens + env.wrap + args.turn_tokens
            assert f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" \
                in text
            read += len(result)
        assert [m["role"] for m in e.messages[2:]] == ["assistant", "tool"] * (e.turns - 1) + ["assistant"]

    # an environment that would grow the history past max_model_len: the episode ends at the engine's bound
    short = long_episode.options(SMALL[:5] + ["340"] + SMALL[6:])
    bounded = long_episode.build_engine(short, long_episode.build_model(short, "consistent"), chat)
    episodes, _, _, _ = long_episode.rollout(bounded, chat, env, short, 10, short.seed)
    assert all(e.finish_reason == "length" and len(e) <= 340 for e in episodes)
    # a prompt at or past max_model_len is refused, naming the field
    with pytest.raises(RuntimeError, match=r"prompt length \d+ >= max_model_len 340 .*raise max_model_len"):
        run_episodes(bounded, [[5] * 340], env, SamplingParams(max_tokens=4), 2)


def test_bad_sizes_are_refused_by_name(capsys):
    for argv, field in ((SMALL[:5] + ["240"], "--tokens 240 leaves no room"),
                        (SMALL + ["--micro-batch-tokens", "100"], "--micro-batch-tokens [100]"),
                        (SMALL[:5] + ["50000"], "--tokens 50000 > max_position_embeddings")):
        with pytest.raises(SystemExit):
            long_episode.options(argv)
        assert field in capsys.readouterr().err


def test_a_setting_out_of_memory_is_reported_and_the_others_still_run(monkeypatch):
    args = long_episode.options(SMALL + ["--micro-batch-tokens", "400", "0"])
    chat = long_episode.chat_encoder(model_config(args.model).vocab_size)
    env = long_episode.LogEnv(chat, args.tokens, args.turn_tokens, args.reply_tokens)
    engine = long_episode.build_engine(args, long_episode.build_model(args, "consistent"), chat)
    episodes, r, _, _ = long_episode.rollout(engine, chat, env, args, 0, args.seed)
    actor = Actor(long_episode.build_model(args, "consistent"), long_episode.BLOCK_SIZE, args.lr)
    backward = actor.backward

    def whole_batch_too_big(r, loss_fn, micro_batch_tokens=None, **kwargs):
        if micro_batch_tokens is None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return backward(r, loss_fn, micro_batch_tokens, **kwargs)

    monkeypatch.setattr(actor, "backward", whole_batch_too_big)
    trainer = long_episode.train(actor, r, episodes, args)
    oom = "out of memory: CUDA out of memory. Tried to allocate 9.00 GiB"
    assert [s.get("error") for s in trainer["settings"]] == [None, oom, None]
    assert trainer["weights_changed_frac"] > 0.5

    # the last settings out of memory too (an H100's first 32K run): the step still takes a good setting's
    # gradients, not the cleared ones the failed backward left
    def only_micro_batches_with_recompute(r, loss_fn, micro_batch_tokens=None, **kwargs):
        if micro_batch_tokens is None or not actor.recompute:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return backward(r, loss_fn, micro_batch_tokens, **kwargs)

    monkeypatch.setattr(actor, "backward", only_micro_batches_with_recompute)
    trainer = long_episode.train(actor, r, episodes, args)
    assert [s.get("error") for s in trainer["settings"]] == [None, oom, oom]
    assert trainer["grad_norm"] > 0 and trainer["weights_changed_frac"] > 0.5
