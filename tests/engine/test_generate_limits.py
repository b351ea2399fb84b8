"""`onepath generate` within the checkpoint's limits: max_model_len never past its max_position_embeddings, a
failed prompt fails the command (the others still print), characters outside the vocabulary named; the
engine's progress bar counts the tokens a generate runs."""
import pytest
import torch

from onepath.cli import main
from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models import build_decoder
from onepath.models.checkpoint import save_checkpoint, unknown_characters
from onepath.models.config import ModelConfig
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.tasks.arithmetic import EOS_ID, build_tokenizer
from tests.tiny import random_prompts, tiny_model


def checkpoint(path, positions: int):
    """A random arithmetic-tokenizer model with `positions` positions, saved as a Hugging Face checkpoint."""
    tokenizer = build_tokenizer()
    config = ModelConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         model_type="qwen3", max_position_embeddings=positions, eos_token_id=EOS_ID)
    model = build_decoder(config, Ops(ExecutionSpec.default("consistent", "cpu")), max_positions=positions)
    model.init_weights(0)
    save_checkpoint(path, model.hf_state_dict(), config, tokenizer)
    return str(path)


def test_max_model_len_past_the_checkpoints_positions_is_refused(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", 64)
    assert main(["generate", ckpt, "1+1=", "--rollout.max_model_len", "512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout.max_model_len = 512 > max_position_embeddings = 64" in err
    assert ckpt in err and "--rollout.max_model_len 64" in err
    assert main(["generate", ckpt, "1+1=", "--rollout.max_model_len", "64"]) == 0  # the checkpoint's own limit


def test_the_default_max_model_len_is_capped_by_the_checkpoint(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", 32)  # fewer positions than rollout.max_model_len's default 64
    assert main(["generate", ckpt, "1+1=", "1" * 40]) == 1
    captured = capsys.readouterr()
    assert "'1+1=' ->" in captured.out
    assert "prompt length 41 >= max_model_len 32" in captured.err  # <bos> + 40 characters


def test_a_failed_prompt_fails_the_command_and_the_others_still_print(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", 64)
    assert main(["generate", ckpt, "1+1=", "1" * 200, "2+2="]) == 1
    captured = capsys.readouterr()
    assert "'1+1=' ->" in captured.out and "'2+2=' ->" in captured.out and "error" not in captured.out
    assert "prompt length 201 >= max_model_len 64" in captured.err and "1 of 3 prompts failed" in captured.err


def test_characters_outside_the_vocabulary_are_named(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "ckpt", 64)
    assert main(["generate", ckpt, "1+1=", "1+é=ü"]) == 0
    err = capsys.readouterr().err
    assert "warning: prompt 1 '1+é=ü' has 'é', 'ü' outside the tokenizer's vocabulary" in err
    assert "prompt 0" not in err
    assert unknown_characters(build_tokenizer(), "7*8=") == []


def test_device_cuda_without_cuda_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", checkpoint(tmp_path / "ckpt", 64), "1+1=", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: this torch" in err and "--device cpu" in err


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_the_progress_bar_counts_the_tokens_a_generate_runs(ignore_eos):
    prompts = random_prompts(torch.Generator().manual_seed(0), 6, high=20)
    params = [SamplingParams(max_tokens=n, seed=i, ignore_eos=ignore_eos) for i, n in enumerate([3, 9, 1, 30, 5, 12])]
    engine = LLMEngine(tiny_model("consistent"), num_blocks=64, scheduler=SchedulerConfig(max_model_len=32))
    bar = engine.progress_bar("test", [engine.add_request(p, q) for p, q in zip(prompts, params)])
    bar.close()
    while engine.has_unfinished():
        engine.step()
    ran = engine.stats.prefill_tokens + engine.stats.generated_tokens
    # each prompt, then each sampled token but the last, up to max_model_len; EOS may stop a request sooner
    assert ran == bar.total if ignore_eos else 0 < ran <= bar.total
    assert engine.generate([], [], progress="test") == []


def test_progress_changes_no_output():
    prompts = random_prompts(torch.Generator().manual_seed(1), 5, high=20)
    params = [SamplingParams(max_tokens=8, seed=i, temperature=0.9) for i in range(len(prompts))]
    outs = []
    for progress in (None, "test"):
        engine = LLMEngine(tiny_model("consistent"), num_blocks=64, scheduler=SchedulerConfig(max_model_len=32))
        outs.append([(o.token_ids, o.logprobs) for o in engine.generate(prompts, params, progress=progress)])
    assert outs[0] == outs[1]
