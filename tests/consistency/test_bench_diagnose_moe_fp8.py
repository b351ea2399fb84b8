"""bench/diagnose_moe_fp8.py on the CPU (tiny MoE, block FP8): each defect planted on one side is named
as the first divergent site, with the right verdict; on the real path no token differs (the negative
control)."""
from bench import diagnose_moe_fp8 as diagnose

SMALL = dict(device="cpu", requests=6, prompt_len=40, max_tokens=12)


def test_planted_expert_defect_is_named_and_blamed_on_the_launch(capsys):
    """Split-K in the trainer's experts above two rows: layer 0's experts, and the row alone has the
    engine's bits, so the trainer's bits follow its launch."""
    result = diagnose.locate(**SMALL, plant="experts")
    out = capsys.readouterr().out
    assert result["tokens"], out
    assert result["site"] == "experts at model.layers.0.mlp.experts", out
    assert result["verdict"].startswith("the launch"), out
    assert "the row alone: engine == trainer yes" in out


def test_planted_decode_attention_is_named_in_a_decode_step_and_blamed_on_the_module(capsys):
    """The engine's decode steps run the baseline attention: the first differing token is decoded, the
    site is layer 0's attention op, and the trainer's attention gives the engine's launch other bits."""
    result = diagnose.locate(**SMALL, plant="decode-attention")
    out = capsys.readouterr().out
    assert result["engine_phase"] == "a decode step", out
    assert result["site"] == "attention at model.layers.0.self_attn", out
    assert result["verdict"].startswith("the module"), out


def test_real_path_has_no_divergence(capsys):
    result = diagnose.locate(**SMALL)
    out = capsys.readouterr().out
    assert result["metrics"]["rollout_corr/valid_tokens"] > 0
    assert result["tokens"] == [] and result["site"] is None, out
    assert "no divergence" in out
