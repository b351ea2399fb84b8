"""onepath/configs/qwen3-0.6b-gpu.yaml: the Qwen3-0.6B shape, and the same run shrunk on the CPU."""
from pathlib import Path

import onepath
from onepath.config import load_run_config
from onepath.numerics.diff import is_exact
from onepath.train.trainer import GRPOTrainer, prepare

GPU = Path(onepath.__file__).parent / "configs" / "qwen3-0.6b-gpu.yaml"
SHRINK = ["--device", "cpu", "--model.num_hidden_layers", "2", "--model.hidden_size", "64",
          "--model.intermediate_size", "128", "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2",
          "--model.head_dim", "16", "--warm_start.steps", "5", "--train.steps", "2", "--train.prompts_per_step", "4",
          "--data.n_test", "8"]


def test_gpu_config_is_the_qwen3_0_6b_shape():
    cfg = load_run_config(GPU, [])
    m = cfg.model
    assert (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads,
            m.head_dim, m.model_type, m.tie_word_embeddings) == (1024, 3072, 28, 16, 8, 128, "qwen3", True)
    assert cfg.device == "cuda" and cfg.mode == "both" and cfg.train.steps >= 50
    assert cfg.train.old_logprob == "verify" and cfg.train.save_every == 25 and cfg.train.val_every == 10
    # a step's sequences fit the engine at once: one KV block each (prompt + response <= block_size)
    r = cfg.rollout
    assert r.max_num_seqs >= cfg.train.prompts_per_step * r.n and r.num_blocks > r.max_num_seqs


def test_gpu_config_shrunk_runs_on_cpu(tmp_path):
    cfg = load_run_config(GPU, [*SHRINK, "--out", str(tmp_path)])
    setup = prepare(cfg, tmp_path, progress=False)
    assert setup.model_config.head_dim == 16 and setup.model_config.vocab_size == setup.tokenizer.get_vocab_size()
    history = GRPOTrainer(cfg, "consistent", setup, tmp_path / "consistent").run(progress=False)
    assert len(history) == 2 and all(is_exact(m) for m in history)
