"""An external agent drives the rollout over HTTP (rollout.agent http). The agent is a plain loop over the
OpenAI Python client (tests/serving.py) running multi-turn tool episodes; the server keeps each episode's
tokens (token in, token out), so an agent doing what ToolEnv does gets, bit for bit, the episodes the
trainer samples in process; the trainer trains on them with diff = 0 on every policy token, the baseline
reports a diff (negative control)."""
import json
import threading

import pytest
import torch

from onepath.chat.tools import Toolbox, calculator
from onepath.config import load_run_config
from onepath.engine.sampling_params import SamplingParams
from onepath.numerics.diff import is_exact
from onepath.serve.episodes import AgentEpisodes
from onepath.train.episodes import turn_request_id
from onepath.train.trainer import GRPOTrainer, prepare
from tests.chat_families import write_chat_checkpoint
from tests.serving import (CALCULATOR_PROMPTS, MODEL, calculator_episodes, chat_engine, get, post, qwen3_template,
                           run_agent, serving)

PROMPTS = CALCULATOR_PROMPTS


def test_an_agent_over_http_gets_the_episodes_the_trainer_samples_itself():
    toolbox, params, ids, expected = calculator_episodes()

    store = AgentEpisodes(MODEL, turn_request_id)
    with serving(chat_engine(max_model_len=1024), qwen3_template(), episodes=store) as (url, _):
        store.open(3, 0, [(eid, {"prompt": p}) for eid, p in zip(ids, PROMPTS)], params)
        agent = threading.Thread(target=run_agent, args=(url, toolbox, 3))
        agent.start()
        got = store.wait(120)
        record = get(f"{url}/episodes/{ids[0]}")
        store.close()
        agent.join()
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids and g.policy_mask == e.policy_mask and g.segments == e.segments
        assert torch.equal(torch.tensor(g.logprobs), torch.tensor(e.logprobs))
        assert g.weight_versions == [0] * g.turns
    assert record["token_ids"] == got[0].token_ids and record["logprobs"] == got[0].logprobs


def test_an_episode_refuses_a_rewritten_conversation_and_concurrent_requests():
    store = AgentEpisodes(MODEL, turn_request_id)
    params = SamplingParams(max_tokens=6, seed=1)
    with serving(chat_engine(), qwen3_template(), episodes=store) as (url, _):
        store.open(1, 0, [(7, {"prompt": PROMPTS[0]})], params)
        base = f"{url}/episodes/7/v1/chat/completions"
        status, first = post(base, {"model": MODEL, "messages": PROMPTS[0]})
        assert status == 200
        turn = first["choices"][0]["message"]
        edited = {**turn, "content": (turn["content"] or "") + "!"}
        status, body = post(base, {"model": MODEL, "messages": PROMPTS[0] + [edited, {"role": "user", "content": "?"}]})
        assert status == 400 and body["error"]["param"] == "messages[2]" and "as the server returned it" in \
            body["error"]["message"]
        status, body = post(base, {"model": MODEL, "messages": PROMPTS[0] + [turn]})
        assert status == 400 and "no message after the last assistant turn" in body["error"]["message"]
        status, body = post(base, {"model": MODEL, "messages": PROMPTS[0] + [turn, {"role": "user", "content": "?"}],
                                   "temperature": 0.5})
        assert status == 400 and body["error"]["param"] == "temperature"
        status, body = post(f"{url}/episodes/8/v1/chat/completions", {"model": MODEL, "messages": PROMPTS[0]})
        assert status == 404 and "not open" in body["error"]["message"]
        assert post(f"{url}/episodes/7/finish", {"reward": "high"})[0] == 400
        assert post(f"{url}/episodes/7/finish", {"reward": 0.5})[0] == 200
        status, body = post(base, {"model": MODEL, "messages": PROMPTS[0] + [turn, {"role": "user", "content": "?"}]})
        assert status == 409 and "finished" in body["error"]["message"]
        (episode,) = store.wait(5)
        assert episode.reward_info["reward"] == 0.5 and episode.turns == 1


def digits(messages) -> float:
    return sum(c.isdigit() for c in messages[-1].get("content") or "") / 8


def agent_run(tmp_path, mode: str) -> list[dict]:
    ckpt = write_chat_checkpoint(tmp_path / "ckpt", "qwen3", eos="<|endoftext|>", max_position_embeddings=2048)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": p, "reward_model": {"ground_truth": "0"}}) + "\n" for p in PROMPTS))
    cfg = load_run_config(None, [
        "--model.path", str(ckpt), "--data.train_path", str(rows), "--train.steps", "2", "--train.prompts_per_step",
        "2", "--rollout.n", "2", "--rollout.max_tokens", "20", "--rollout.max_model_len", "1024",
        "--rollout.num_blocks", "512", "--rollout.max_num_batched_tokens", "2048", "--train.val_every", "0",
        "--rollout.agent", "http", "--rollout.agent_port", "0", "--rollout.agent_timeout_s", "120",
        "--mode", mode, "--out", str(tmp_path / mode)])
    trainer = GRPOTrainer(cfg, mode, prepare(cfg, tmp_path / mode, progress=False), tmp_path / mode / "run")
    history, failure = [], []

    def train_run():
        try:
            history.extend(trainer.run(progress=False))
        except BaseException as e:  # noqa: BLE001: re-raised below, where the test fails with it
            failure.append(e)

    train = threading.Thread(target=train_run)
    train.start()
    try:
        episodes = run_agent(trainer.agent.url, Toolbox([calculator]), 3, reward=digits)
    except OSError:
        train.join(timeout=5)
        if failure:  # the trainer stopped (and its server with it): its error, not the agent's
            raise failure[0]
        raise
    train.join()
    if failure:
        raise failure[0]
    assert episodes == 2 * 2 * 2 and len(history) == 2
    return history


@pytest.mark.slow
def test_an_agent_driven_run_trains_with_diff_zero_on_every_policy_token(tmp_path):
    history = agent_run(tmp_path, "consistent")
    assert all(is_exact(m) and m["rollout_corr/valid_tokens"] > 0 for m in history)
    assert any(m["episode/turns/mean"] > 1 for m in history)
    assert all(m["response_length/mean"] == m["episode/policy_tokens/mean"] for m in history)
    assert any(m["critic/score/mean"] > 0 for m in history)  # the agent's rewards reached the update


@pytest.mark.slow
def test_an_agent_driven_baseline_run_reports_a_diff(tmp_path):
    history = agent_run(tmp_path, "baseline")
    assert not all(is_exact(m) for m in history)


@pytest.mark.parametrize("extra, match", [
    (["--rollout.agent", "grpc"], r"rollout.agent = 'grpc' is not an agent mode"),
    (["--rollout.agent", "http", "--rollout.env", "calculator"], r"rollout.env = 'calculator' is set with rollout.agent"),
    (["--rollout.agent", "http", "--mode", "both"], r"mode = 'both' is refused with rollout.agent = http"),
    (["--rollout.agent", "http", "--parallel.trainer", "fsdp"], r"set parallel.rollout and parallel.trainer single"),
    (["--rollout.agent", "http", "--rollout.agent_port", "70000"], r"rollout.agent_port = 70000 must be a port"),
    (["--rollout.agent", "http", "--rollout.agent_timeout_s", "0"], r"rollout.agent_timeout_s = 0.0 must be a finite"),
])
def test_agent_settings_are_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, extra)


def test_the_agent_needs_a_chat_template(tmp_path):
    cfg = load_run_config(None, ["--rollout.agent", "http", "--rollout.agent_port", "0", "--warm_start.steps", "0",
                                 "--data.n_train", "8", "--data.n_test", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="rollout.agent = http needs a chat template"):
        GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "run")
