"""Bad input to the command line is one line naming the value and what to do, before any work: --device cuda
without CUDA, --out at a file, an unreadable data file, an unknown model name."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from onepath.cli import main
from onepath.train.data import load_rows

QUICK = ["--warm_start.steps", "0", "--train.steps", "1", "--train.prompts_per_step", "2", "--rollout.n", "2",
         "--data.n_train", "8", "--data.n_test", "0", "--quiet"]


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", [["train", "--out", "{tmp}/run"], ["check", "tiny", "--gates", "C2"],
                                     ["bisect", "tiny", "--out", "{tmp}/run"], ["diagnose", "tiny"]])
def test_device_cuda_without_cuda_says_so(command, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([a.format(tmp=tmp_path) for a in command] + ["--device", "cuda"]) == 2
    err = one_line(capsys)
    assert f"onepath {command[0]}: error: --device cuda: this torch {torch.__version__}" in err
    assert "run with --device cpu" in err
    assert not (tmp_path / "run").exists()


def test_out_at_a_file_says_so_before_any_work(tmp_path, capsys):
    file = tmp_path / "notes.txt"
    file.write_text("mine")
    assert main(["train", "--out", str(file), *QUICK]) == 2
    assert f"--out {file} is a file: give a directory for the run" in one_line(capsys)
    assert main(["train", "--out", str(file / "run"), *QUICK]) == 2
    assert f"is inside {file}, which is a file" in one_line(capsys)
    assert file.read_text() == "mine"


@pytest.mark.parametrize("content", ["empty", "cut short", "not parquet"])
def test_an_unreadable_parquet_file_names_itself_before_the_warm_start(content, tmp_path, capsys):
    path = tmp_path / "train.parquet"
    if content == "empty":
        path.touch()
    elif content == "cut short":
        pq.write_table(pa.table({"prompt": ["1+1="] * 50, "reward_model": [{"ground_truth": "2"}] * 50}), path)
        path.write_bytes(path.read_bytes()[:-20])
    else:
        path.write_text('{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n' * 20)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--data.train_path", str(path), "--warm_start.steps", "5"]) == 2
    err = one_line(capsys)
    assert f"dataset {path} is not a readable parquet file" in err and "write it again" in err
    assert not (out / "warm_start").exists()


def test_a_data_file_that_is_not_utf8_names_itself(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "1+1=\xff"}\n')
    with pytest.raises(ValueError, match=f"dataset {path} is not UTF-8 text"):
        load_rows(path)


def test_threads_below_one_and_an_unknown_model_name_are_one_line(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path / "run"), "--threads", "0"]) == 2
    assert "--threads 0 must be >= 1" in one_line(capsys)
    for command in ("bisect", "diagnose"):
        assert main([command, "tiyn"]) == 2
        assert "model 'tiyn' is neither a checkpoint directory nor 'tiny'" in one_line(capsys)
    assert main(["bisect", "tiny", "--prompt", "1+1"]) == 2
    assert "--prompt needs a tokenizer and model tiny has no tokenizer.json" in one_line(capsys)
