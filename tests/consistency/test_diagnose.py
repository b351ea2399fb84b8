"""diagnose: exact zeros where two sides agree bitwise, small non-zero values where they do not."""
import json
import math

import torch

from onepath.consistency import diagnose as diagnose_cli
from onepath.consistency.diagnose import diagnose
from onepath.consistency.recorder import Layout
from onepath.models.checkpoint import save_checkpoint
from tests.tiny import random_prompts, tiny_model

MODULES = ("self_attn:attention", "mlp.gate_proj:linear", "mlp.up_proj:linear", "mlp.down_proj:linear")
STATS = ("logprob_abs_diff_p50", "logprob_abs_diff_p99", "logprob_abs_diff_max", "ratio_outside_clip_frac",
         "k3_kl", "tokens_differing_frac", "probs_diff_max")


def sequences():
    return random_prompts(torch.Generator().manual_seed(8), 6, low=2, high=40)


def test_consistent_prefill_vs_decode_is_all_zeros():
    model = tiny_model("consistent")
    seqs = sequences()
    result = diagnose(model, model, seqs, Layout(), Layout(prefill=1))
    assert result["tokens"] == sum(len(s) - 1 for s in seqs)
    assert all(result[k] == 0.0 for k in STATS), result
    assert set(MODULES) <= set(result["modules"])
    assert all(m["rel_l2"] == 0.0 and all(v == 0.0 for v in m["layers"].values()) for m in result["modules"].values())


def test_consistent_vs_baseline_is_small_and_non_zero():
    seqs = sequences()
    result = diagnose(tiny_model("consistent"), tiny_model("baseline"), seqs)
    assert 0 < result["logprob_abs_diff_p99"] <= result["logprob_abs_diff_max"] < 1e-4
    assert 0 <= result["logprob_abs_diff_p50"] <= result["logprob_abs_diff_p99"]
    assert result["ratio_outside_clip_frac"] == 0.0          # a few ULPs never leave 1 +- 0.2
    assert 0 < result["k3_kl"] < 1e-9 and 0 < result["tokens_differing_frac"] <= 1
    assert result["modules"]["embedding"]["rel_l2"] == 0.0  # a gather: exact on both backends
    for name in MODULES:
        m = result["modules"][name]
        assert 0 < m["rel_l2"] < 1e-4 and set(m["layers"]) == {"0", "1"}, (name, m)
    # with a clip range narrower than any difference, every differing token falls outside it
    narrow = diagnose(tiny_model("consistent"), tiny_model("baseline"), seqs, eps=1e-12)
    assert narrow["ratio_outside_clip_frac"] == narrow["tokens_differing_frac"]
    assert json.loads(json.dumps(result)) == result


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    model = tiny_model("consistent")
    save_checkpoint(tmp_path / "ckpt", model.hf_state_dict(), model.config)
    assert diagnose_cli.main([str(tmp_path / "ckpt"), "--num-sequences", "3", "--length", "12",
                              "--json", str(tmp_path / "d.json")]) == 0
    out = capsys.readouterr().out
    assert "P99" in out and "mlp.down_proj:linear" in out and "k3 KL" in out
    result = json.loads((tmp_path / "d.json").read_text())
    assert result["tokens"] == 3 * 11 and result["logprob_abs_diff_max"] > 0 and not math.isnan(result["k3_kl"])
    assert diagnose_cli.main([str(tmp_path / "ckpt"), "--sides", "prefill-decode", "--json",
                              str(tmp_path / "p.json")]) == 0
    assert json.loads((tmp_path / "p.json").read_text())["logprob_abs_diff_max"] == 0.0


def test_quantised_specs_naive_vs_aligned(tmp_path):
    """The low-precision table's two settings: the trainer ignoring the engine's FP8 (naive) differs,
    both sides quantising by the spec (aligned) reads exactly 0."""
    model = tiny_model("consistent", hidden_size=128, intermediate_size=256)
    save_checkpoint(tmp_path / "ckpt", model.hf_state_dict(), model.config)
    results = {}
    for name, spec_a in (("naive", "consistent"), ("aligned", "consistent+fp8+fp8_kv")):
        out = tmp_path / f"{name}.json"
        assert diagnose_cli.main([str(tmp_path / "ckpt"), "--spec-a", spec_a, "--spec-b", "consistent+fp8+fp8_kv",
                                  "--num-sequences", "3", "--length", "20", "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["naive"]["logprob_abs_diff_max"] > 0 and results["naive"]["k3_kl"] > 0
    aligned = results["aligned"]
    assert aligned["logprob_abs_diff_max"] == 0 and aligned["k3_kl"] == 0
    assert all(m["rel_l2"] == 0 for m in aligned["modules"].values())
