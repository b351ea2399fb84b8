"""bisect names the first diverging operator and its layer, and its repro script alone shows the difference.

The planted defect is a backend whose linear switches to a split-K reduction when a launch has more
than 8 rows: a request alone (6 rows) and inside a batch (> 8 rows) then differ first at layer 0's
first linear. The real consistent path shows no divergence on every pair of sides; the baseline
on the same sides does (negative control)."""
import json
import subprocess
import sys

import pytest
import torch

from onepath.consistency import bisect as bisect_cli
from onepath.consistency.bisect import Side, bisect, ulp_distance
from onepath.consistency.recorder import Layout, trace
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.checkpoint import save_checkpoint
from onepath.models.dense import DenseDecoder
from onepath.numerics.spec import ExecutionSpec
from tests.tiny import random_prompts, tiny_config, tiny_model, tiny_moe_model
from tests.planted import DecodeBaselineAttentionOps, SplitKAboveEightOps, SplitKExpertsAboveTwoRowsOps

PROBE = [5, 9, 14, 3, 22, 41]
OTHERS = [[7, 8, 9, 10], [30, 31, 32, 33, 34, 35, 36]]


def planted_model() -> DenseDecoder:
    model = DenseDecoder(tiny_config(), SplitKAboveEightOps(ExecutionSpec.default("consistent")), max_positions=256)
    model.init_weights(0, std=0.15)
    return model


def run_repro(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})


def test_planted_m_dependent_linear_is_named_with_its_layer_and_reproduces_alone(tmp_path):
    model = planted_model()
    report = bisect(Side(model), Side(model, others=OTHERS, at=1), PROBE, tmp_path / "repro")
    first = report.first
    assert first is not None
    assert (first.op, first.layer, first.module) == ("linear", 0, "model.layers.0.self_attn.q_proj")
    assert first.shape == [len(PROBE), 64] and first.differing > 0 and first.max_abs > 0 and first.max_ulp >= 1
    assert all(s.differing == 0 for s in report.sites[:first.site])
    case = json.loads((tmp_path / "repro" / "case.json").read_text())
    assert case["a"]["ops_class"].endswith(":SplitKAboveEightOps") and case["positions"] == list(range(len(PROBE)))
    assert report.reproduces
    out = run_repro(report.repro)
    assert out.returncode == 1, out.stderr
    assert "DIFFER" in out.stdout and "reproduces" in out.stdout


def test_planted_defect_is_invisible_when_both_sides_launch_the_same_rows():
    model = planted_model()
    assert bisect(Side(model), Side(model), PROBE).first is None


def sides(mode: str) -> dict[str, tuple[Side, Side, list[int]]]:
    model = tiny_model(mode)
    gen = torch.Generator().manual_seed(4)
    probe = random_prompts(gen, 1, low=20, high=30)[0]
    others = random_prompts(gen, 3)
    trainer = Side(model, label="trainer")
    return {
        "alone vs batch": (trainer, Side(model, others=others, at=2), probe),
        "prefill vs decode": (trainer, Side(model, Layout(prefill=1)), probe),
        "prefill vs chunked prefill": (trainer, Side(model, Layout(chunk=7)), probe),
        "trainer vs engine": (trainer, Side(model, Layout(prefill=9, head="last"), others, 1, "engine"), probe),
    }


@pytest.mark.parametrize("name", ["alone vs batch", "prefill vs decode", "prefill vs chunked prefill",
                                  "trainer vs engine"])
def test_consistent_path_has_no_divergence_and_baseline_does(name):
    a, b, probe = sides("consistent")[name]
    report = bisect(a, b, probe)
    assert report.first is None, report.format()
    assert all(s.elements > 0 for s in report.sites)
    a, b, probe = sides("baseline")[name]
    assert bisect(a, b, probe).first is not None


def test_consistent_vs_baseline_spec_names_the_first_differing_op(tmp_path):
    consistent, baseline = tiny_model("consistent"), tiny_model("baseline")
    probe = PROBE * 3
    report = bisect(Side(consistent), Side(baseline), probe, tmp_path)
    # the embedding is a gather (exact on both); the first reduction is layer 0's input RMSNorm
    assert report.sites[0].op == "embedding" and report.sites[0].differing == 0
    assert (report.first.op, report.first.module) == ("rmsnorm", "model.layers.0.input_layernorm")
    out = run_repro(report.repro)
    assert out.returncode == 1 and "DIFFER" in out.stdout, out.stdout + out.stderr


def test_engine_side_replays_the_engine_log_probs_bitwise():
    model = tiny_model("consistent")
    prompt = [4, 17, 9, 30, 12]
    engine = LLMEngine(model, num_blocks=32, block_size=16, scheduler=SchedulerConfig(max_model_len=64))
    out = engine.generate([prompt], SamplingParams(max_tokens=10, seed=3))[0]
    seq = prompt + out.token_ids
    t = trace(model, [seq], Layout(prefill=len(prompt), head="last"))
    rows = t.rows[-1][0]
    assert rows.positions == list(range(len(prompt) - 1, len(seq)))
    assert torch.equal(rows.values[0][:-1], torch.tensor(out.logprobs))


def test_moe_experts_are_one_site_per_layer_and_the_engine_side_agrees():
    """An MoE's experts run ops over (token, expert) pairs: each layer's experts are one site, their
    [T, k, H] output; the consistent trainer and engine sides agree on every site, experts included."""
    model = tiny_moe_model("consistent")
    gen = torch.Generator().manual_seed(6)
    probe, others = random_prompts(gen, 1, low=20, high=30)[0], random_prompts(gen, 3)
    report = bisect(Side(model), Side(model, Layout(prefill=9, head="last"), others, 1), probe)
    experts = [s for s in report.sites if s.op == "experts"]
    assert [s.module for s in experts] == [f"model.layers.{i}.mlp.experts" for i in range(model.config.num_hidden_layers)]
    assert all(s.elements > 0 and s.shape[1:] == [model.config.num_experts_per_tok, model.config.hidden_size]
               for s in experts)
    assert report.first is None, report.format()


def test_planted_expert_defect_is_named_at_the_experts_and_reruns_alone(tmp_path):
    """A defect inside the experts (split-K once an expert has more than two rows) shows first at the
    layer's experts site, after every site before it agreed; no repro script (the site needs the
    module's weights), but the rerun on the captured inputs still differs."""
    model = tiny_moe_model("consistent")
    model.ops = SplitKExpertsAboveTwoRowsOps(model.ops.spec)
    for m in model.modules():
        if "ops" in vars(m):
            m.ops = model.ops
    gen = torch.Generator().manual_seed(7)
    probe, others = random_prompts(gen, 1, low=6, high=6)[0], random_prompts(gen, 6, low=20, high=30)
    report = bisect(Side(model), Side(model, others=others, at=3), probe, tmp_path / "repro")
    assert report.first is not None and report.first.op == "experts", report.format()
    assert report.first.module.endswith(".mlp.experts")
    assert all(s.differing == 0 for s in report.sites[:report.first.site])
    assert report.repro is None and report.reproduces
    assert "module-level site" in report.format()
    assert bisect(Side(model), Side(model), probe).first is None


def test_ulp_distance():
    x = torch.tensor([1.0, -2.0, 0.0, 3.0])
    y = torch.nextafter(x, torch.tensor(float("inf")))
    assert ulp_distance(x, y).tolist() == [1, 1, 1, 1]
    assert int(ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0]))) == 0
    tiny = torch.tensor([1e-45])
    assert int(ulp_distance(tiny, -tiny)) == 2
    b = torch.tensor([1.0], dtype=torch.bfloat16)
    assert int(ulp_distance(b, torch.nextafter(b, torch.tensor([2.0], dtype=torch.bfloat16)))) == 1


def test_cli_names_the_planted_defect_and_passes_the_real_path(tmp_path, capsys):
    model = tiny_model("consistent")
    save_checkpoint(tmp_path / "ckpt", model.hf_state_dict(), model.config)
    planted = f"{SplitKAboveEightOps.__module__}:SplitKAboveEightOps"
    tokens = ",".join(map(str, PROBE))
    code = bisect_cli.main([str(tmp_path / "ckpt"), "--sides", "batch", "--ops-a", planted, "--ops-b", planted,
                            "--tokens", tokens, "--out", str(tmp_path / "repro"), "--json", str(tmp_path / "r.json")])
    assert code == 1
    assert "FIRST DIVERGENCE: linear at model.layers.0.self_attn.q_proj (layer 0" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["first"]["op"] == "linear"
    assert (tmp_path / "repro" / "repro.py").is_file()
    for preset in ("engine-trainer", "prefill-decode", "batch"):
        assert bisect_cli.main([str(tmp_path / "ckpt"), "--sides", preset, "--out", str(tmp_path / "none")]) == 0
    assert bisect_cli.main([str(tmp_path / "ckpt"), "--sides", "spec", "--out", str(tmp_path / "spec")]) == 1


def test_planted_decode_attention_is_named_and_its_repro_carries_the_kv_cache(tmp_path):
    model = DenseDecoder(tiny_config(), DecodeBaselineAttentionOps(ExecutionSpec.default("consistent")), max_positions=256)
    model.init_weights(0, std=0.15)
    report = bisect(Side(model), Side(model, Layout(prefill=4)), PROBE * 3, tmp_path)
    assert (report.first.op, report.first.layer) == ("attention", 0)
    assert report.first.first_position == 4 and report.reproduces  # the first decoded token
    case = json.loads((tmp_path / "case.json").read_text())
    assert case["b"]["args"]["meta"]["fields"]["context_lens"] == {"value": [5]}
    out = run_repro(report.repro)
    assert out.returncode == 1 and "DIFFER" in out.stdout, out.stdout + out.stderr
