"""The command line's help: `onepath --help` lists every command, each command's --help lists its options and
an example, `train --help` the common options and the --section.key settings; `tiny` is one model name for
check, bisect and diagnose."""
from dataclasses import fields

import pytest
import torch

from onepath import cli
from onepath.cli import main
from onepath.config import SECTIONS
from onepath.consistency import bisect as bisect_cli
from onepath.consistency import diagnose as diagnose_cli
from onepath.consistency.bisect import load_weights
from onepath.consistency.gates import GateContext


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_onepath_help_lists_every_command_with_a_line_and_exits_0(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    for name, (_, line) in cli.COMMANDS.items():
        assert f"  {name:<10s}{line}" in out
    assert "example: onepath train" in out


def test_no_command_or_an_unknown_one_lists_the_commands_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in cli.COMMANDS)
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "  train " in err


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        main([*argv, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", [["bench", "rollout"], *([c] for c in cli.COMMANDS)])
def test_every_command_help_lists_its_options_and_an_example(command, capsys):
    out = help_of(command, capsys)
    assert "options:" in out and "-h, --help" in out
    example = [line for line in out.splitlines() if line.lstrip().startswith(f"onepath {' '.join(command)} ")
               or line.startswith(f"example: onepath {' '.join(command)} ")]
    assert example, out


def test_train_help_lists_the_common_options_and_the_settings(capsys):
    out = help_of(["train"], capsys)
    for option in ("--config", "--out", "--mode", "--device", "--quant", "--resume", "--threads", "--quiet"):
        assert f"  {option}" in out, option
    assert "--section.key value" in out
    for name, section in SECTIONS.items():
        line = next(line for line in out.splitlines() if line.startswith(f"    {name} "))
        assert fields(section)[0].name in line, name
    assert "onepath train --config my.yaml --out runs/mine --train.steps 50" in out


def test_train_options_and_overrides_reach_the_run_config(tmp_path, monkeypatch):
    seen = {}

    def run(cfg, resume, progress):
        seen.update(cfg=cfg, resume=resume, progress=progress)
        return 0
    monkeypatch.setattr("onepath.train.run.run", run)
    out = tmp_path / "run"
    assert main(["train", "--mode", "both", f"--out={out}", "--train.steps", "3", "--device", "cpu", "--resume",
                 "--quiet", "--quant", "fp8"]) == 0
    cfg = seen["cfg"]
    assert (cfg.mode, cfg.out, cfg.device, cfg.quant, cfg.train.steps) == ("both", str(out), "cpu", "fp8", 3)
    assert seen["resume"] and not seen["progress"]


def test_bisect_and_diagnose_take_tiny_with_checks_weights(tmp_path, capsys):
    ctx = GateContext.load("tiny", seed=3)
    config, state, tokenizer, label = load_weights("tiny", seed=3)
    assert (config, label, tokenizer) == (ctx.config, "tiny", None)
    assert state.keys() == ctx.state.keys() and all(torch.equal(state[k], ctx.state[k]) for k in state)
    assert bisect_cli.main(["tiny", "--sides", "batch", "--length", "8", "--out", str(tmp_path / "repro")]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert diagnose_cli.main(["tiny", "--num-sequences", "2", "--length", "8"]) == 0
    assert "tokens of 2 sequences" in capsys.readouterr().out
