"""train.old_logprob (verify | every_n | skip): in consistent mode all three train the same weights
bit for bit, the payoff of diff = 0; in baseline mode they differ (negative control).
train.val_every (and train.val_before_train): evaluation on the held-out split leaves the training trajectory
untouched.
GSM8K- and DAPO-style rows load from JSONL and parquet and run GRPO steps with math_answer."""
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from onepath.config import load_run_config
from onepath.numerics.diff import DIFF_METRICS, is_exact
from onepath.engine.llm_engine import LLMEngine
from onepath.train.data import load_rows, prompt_text, reward_kwargs
from onepath.train.metrics import read_metrics
from onepath.train.rewards import math_answer
from onepath.train.trainer import GRPOTrainer, prepare

DATA = Path(__file__).resolve().parents[1] / "data"
def config(tmp_path, *extra):
    return load_run_config(None, ["--warm_start.steps", "0", "--train.steps", "3", "--train.prompts_per_step", "4",
                                  "--rollout.n", "4", "--data.n_train", "64", "--data.n_test", "8",
                                  "--train.val_every", "0", "--out", str(tmp_path), *extra])


def train(tmp_path, mode, name, *extra):
    cfg = config(tmp_path, *extra)
    trainer = GRPOTrainer(cfg, mode, prepare(cfg, tmp_path, progress=False), tmp_path / name)
    history = trainer.run(progress=False)
    return {k: v.clone() for k, v in trainer.policy.state_dict().items()}, history


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def training(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/", "val/"))}


def test_consistent_verify_every_n_and_skip_train_the_same_weights(tmp_path, reward):
    verify, verified = train(tmp_path, "consistent", "verify", "--train.reward", reward)
    skip, skipped = train(tmp_path, "consistent", "skip", "--train.reward", reward, "--train.old_logprob", "skip")
    every, every_2 = train(tmp_path, "consistent", "every_n", "--train.reward", reward,
                           "--train.old_logprob", "every_n", "--train.old_logprob_every", "2")
    assert same_weights(verify, skip) and same_weights(verify, every)
    assert all(is_exact(m) for m in verified)
    assert not any(k in m for m in skipped for k in DIFF_METRICS)  # skip measures nothing
    assert [all(k in m for k in DIFF_METRICS) for m in every_2] == [True, False, True]  # steps 1, 1 + 2
    assert is_exact(every_2[0]) and is_exact(every_2[2])
    for a, b in zip(verified, skipped):
        assert a["actor/pg_loss"] == b["actor/pg_loss"] and a["actor/grad_norm"] == b["actor/grad_norm"]
    assert "timing_s/old_logprob" in verified[0] and "timing_s/old_logprob" not in skipped[0]


def test_negative_control_baseline_verify_and_skip_differ(tmp_path, reward):
    # baseline old log-probs (trainer's) and the rollout's differ, so the two policies take different steps
    verify, verified = train(tmp_path, "baseline", "verify", "--train.reward", reward)
    skip, _ = train(tmp_path, "baseline", "skip", "--train.reward", reward, "--train.old_logprob", "skip")
    assert any(m["rollout_corr/tokens_differing_frac"] > 0 for m in verified)
    assert not same_weights(verify, skip), "baseline verify and skip trained the same weights: the test is blind"


@pytest.mark.parametrize("mode", ["consistent", "baseline"])
def test_evaluation_leaves_the_training_trajectory_untouched(tmp_path, reward, mode):
    plain, plain_history = train(tmp_path, mode, "plain", "--train.reward", reward)
    evaluated, history = train(tmp_path, mode, "val", "--train.reward", reward, "--train.val_every", "1")
    assert same_weights(plain, evaluated)
    assert [training(m) for m in history] == [training(m) for m in plain_history]
    assert all("val/score" not in m for m in plain_history)
    records = read_metrics(tmp_path / "val")
    assert [0 <= r["val/score"] <= 1 and r["val/response_length/mean"] > 0 for r in records] == [True] * 3


def test_validation_before_training_is_step_0_and_leaves_the_trajectory_untouched(tmp_path, reward):
    """train.val_before_train: one validation of the starting weights, logged as step 0 in metrics.jsonl (not in
    the run's history); the weights and training records are those of a run without it; the report, the summary
    and a resume take the step-0 record as a validation alone, and the resume logs it once."""
    from onepath.train.report import report_figure, report_summary

    plain, plain_history = train(tmp_path, "consistent", "plain", "--train.reward", reward)
    before, history = train(tmp_path, "consistent", "before", "--train.reward", reward, "--train.val_before_train",
                            "true")
    assert same_weights(plain, before)
    assert [training(m) for m in history] == [training(m) for m in plain_history]
    # control: the comparison sees a run that did move (another sampling seed)
    assert not same_weights(plain, train(tmp_path, "consistent", "seed1", "--train.reward", reward, "--train.seed",
                                         "1")[0])
    run = tmp_path / "before"
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and "critic/score/mean" not in records[0]
    assert 0 <= records[0]["val/score"] <= 1 and all("val/score" not in r for r in records[1:])
    (summary,) = report_summary([run]).values()
    assert summary["steps"] == 3 and summary["val_score_last"] == records[0]["val/score"]
    val = next(ax for ax in report_figure([run]).axes if ax.get_label() == "val")
    assert list(val.lines[0].get_xdata()) == [0]
    # a resume to step 4 keeps step 0 as it was and does not validate before its first step again
    more = config(tmp_path, "--train.reward", reward, "--train.val_before_train", "true", "--train.steps", "4")
    resumed = GRPOTrainer(more, "consistent", prepare(more, tmp_path, progress=False), run, resume=True)
    assert len(resumed.run(progress=False)) == 4
    assert [r["step"] for r in read_metrics(run)] == [0, 1, 2, 3, 4] and read_metrics(run)[0] == records[0]


def test_evaluation_steps_request_ids_and_temperature(tmp_path, monkeypatch):
    calls = []
    generate = LLMEngine.generate

    def spy(self, prompts, params, request_ids=None):
        calls.append((len(prompts), params, request_ids))
        return generate(self, prompts, params, request_ids)

    monkeypatch.setattr(LLMEngine, "generate", spy)
    _, history = train(tmp_path, "consistent", "run", "--train.steps", "5", "--train.val_every", "2",
                       "--train.val_temperature", "0.5")
    assert ["val/score" in m for m in history] == [False, True, False, True, True]  # every 2 and the last
    evals = [(n, params, ids) for n, params, ids in calls if max(ids) < 0]
    assert len(evals) == 3 and len(calls) == 8
    assert all(n == 8 and params.temperature == 0.5 for n, params, _ in evals)  # one sample per held-out row
    assert all(min(ids) >= 1_000_000 for _, _, ids in calls if max(ids) >= 0)  # training's ids never below 0
    assert train(tmp_path, "consistent", "off", "--data.n_test", "0", "--train.val_every", "1")[1][0].get(
        "val/score") is None  # no held-out rows: no evaluation


def test_gsm8k_and_dapo_samples_are_scored_by_math_answer():
    for name, answer in (("gsm8k_sample.jsonl", "so {} in all.\n#### {}"), ("dapo_sample.jsonl", "{} \\boxed{{{}}}")):
        rows = load_rows(DATA / name)
        assert len(rows) == 5 and all(isinstance(r["prompt"], list) for r in rows)
        for row in rows:
            truth = row["reward_model"]["ground_truth"]
            assert math_answer(prompt_text(row), answer.format("x", truth), **reward_kwargs(row)) == 1.0, row
            assert math_answer(prompt_text(row), answer.format("x", "123456"), **reward_kwargs(row)) == 0.0, row


@pytest.mark.parametrize("train_file, val_file", [("gsm8k_sample.jsonl", "dapo_sample.jsonl"),
                                                  ("dapo_sample.jsonl", "gsm8k_sample.jsonl")])
def test_math_rows_from_jsonl_and_parquet_run_grpo_steps(tmp_path, train_file, val_file):
    val = tmp_path / (Path(val_file).stem + ".parquet")
    pq.write_table(pa.Table.from_pylist(load_rows(DATA / val_file)), val)
    # the embedded character tokenizer maps letters to <unk>: prompts run (one token a character), answers score ~0
    cfg = load_run_config(None, [
        "--data.train_path", str(DATA / train_file), "--data.val_path", str(val), "--train.reward", "math_answer",
        "--warm_start.steps", "0", "--train.steps", "2", "--train.prompts_per_step", "2", "--rollout.n", "2",
        "--train.val_every", "1", "--rollout.max_tokens", "16", "--rollout.max_model_len", "256",
        "--model.max_position_embeddings", "256", "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    assert len(setup.train_rows) == len(setup.test_rows) == 5
    history = GRPOTrainer(cfg, "consistent", setup, tmp_path / "run").run(progress=False)
    assert len(history) == 2 and all(is_exact(m) for m in history)
    assert all(0 <= m["val/score"] <= 1 and 0 <= m["critic/score/mean"] <= 1 for m in history)
    assert (tmp_path / "run" / "step_2" / "model.safetensors").exists()
