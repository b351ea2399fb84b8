"""`onepath serve CKPT`: a checkpoint behind the OpenAI API, its line at start naming the URL, answering an
OpenAI client, stopped cleanly by SIGTERM; a bad checkpoint or port fails in a line."""
import os
import signal
import subprocess
import sys
from pathlib import Path

from onepath.cli import main
from tests.chat_families import write_chat_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_onepath_serve_answers_an_openai_client(tmp_path):
    from openai import OpenAI
    ckpt = write_chat_checkpoint(tmp_path / "ckpt", "qwen3", max_position_embeddings=512)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "onepath", "serve", str(ckpt), "--port", "0",
                               "--served-model-name", "tiny", "--rollout.max_model_len", "256"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline()
        assert line.startswith("onepath serve: tiny (consistent, cpu, max_model_len 256, chat template "), line
        client = OpenAI(base_url=line.split(" on ")[-1].strip(), api_key="none", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=5, seed=1)
        choice = answer.choices[0]
        assert len(choice.model_extra["token_ids"]) == len(choice.logprobs.content) == answer.usage.completion_tokens
        assert answer.model_extra["weight_version"] == 0 and answer.model_extra["prompt_token_ids"]
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.stderr.read()


def test_a_bad_checkpoint_or_port_fails_in_a_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "onepath serve: error:" in err
    ckpt = write_chat_checkpoint(tmp_path / "ckpt", "qwen3", max_position_embeddings=512)
    assert main(["serve", str(ckpt), "--port", "70000", "--rollout.max_model_len", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--port 70000 must be in [0, 65535]" in err
