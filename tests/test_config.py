from pathlib import Path

import pytest

import onepath
from onepath.config import (DataSection, ModelSection, RolloutSection, RunConfig, TrainSection, WarmStartSection,
                            dump_yaml, engine_settings, load_run_config, sampling_params)
from onepath.models.kv_cache import BLOCK_SIZE

DEMO = Path(onepath.__file__).parent / "configs" / "demo.yaml"


def test_demo_yaml_spells_out_the_defaults():
    assert load_run_config(DEMO, []) == RunConfig()
    assert load_run_config(None, []) == RunConfig()


def test_partial_yaml_then_overrides_in_both_forms(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 3.0e-4\n  steps: 5\nrollout:\n  n: 2\n")
    cfg = load_run_config(path, ["--train.lr", "1e-5", "--rollout.n=4", "--mode", "baseline",
                                 "--warm-start.steps=0", "--data.train_path", "data/train.parquet"])
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 5
    assert cfg.rollout.n == 4 and cfg.mode == "baseline"
    assert cfg.warm_start.steps == 0
    assert cfg.data.train_path == "data/train.parquet"
    assert cfg.model == ModelSection()  # untouched sections keep their defaults


def test_type_conversion(tmp_path):
    cfg = load_run_config(None, [
        "--train.steps", "4", "--train.lr=1e-5", "--train.weight_decay", "0", "--train.betas", "[0.8, 0.95]",
        "--train.norm_adv_by_std", "false", "--rollout.prefill_chunk_size", "32", "--rollout.top_p", "1",
        "--train.reward", "1.10", "--out", "007", "--model.path", "null", "--train.clip_ratio", "2e-1",
    ])
    assert cfg.train.steps == 4 and type(cfg.train.steps) is int
    assert cfg.train.lr == 1e-5
    assert cfg.train.weight_decay == 0.0 and type(cfg.train.weight_decay) is float
    assert cfg.train.betas == (0.8, 0.95)
    assert cfg.train.norm_adv_by_std is False
    assert cfg.rollout.prefill_chunk_size == 32
    assert cfg.rollout.top_p == 1.0 and type(cfg.rollout.top_p) is float
    assert cfg.train.reward == "1.10" and cfg.out == "007"  # string fields keep the token as typed
    assert cfg.model.path is None
    assert cfg.train.clip_ratio == 0.2
    path = tmp_path / "c.yaml"
    path.write_text("warm_start:\n  lr: 1e-2\n  steps: 1e3\n")  # YAML 1.1 reads 1e-2 as a string
    cfg = load_run_config(path, [])
    assert cfg.warm_start.lr == 0.01 and cfg.warm_start.steps == 1000


@pytest.mark.parametrize("overrides, match", [
    (["--train.lrr", "1"], r"unknown key train.lrr: valid keys of train are steps, prompts_per_step, lr,"),
    (["--trian.lr", "1"], r"unknown config section 'trian': valid sections are model, data, warm_start"),
    (["--steps", "1"], r"unknown option --steps: valid keys are model.\*, data.\*"),
    (["--train", "1"], r"--train is a section"),
    (["--train.lr"], r"--train.lr needs a value"),
    (["train.lr", "1"], r"unexpected argument 'train.lr'"),
    (["--rollout.n", "four"], r"rollout.n = 'four' must be an integer"),
    (["--train.steps", "2.5"], r"train.steps = 2.5 must be an integer"),
    (["--train.norm_adv_by_std", "1"], r"train.norm_adv_by_std = 1 must be true or false"),
    (["--train.betas", "0.9"], r"train.betas = 0.9 must be a list of 2 numbers"),
    (["--rollout.n", "0"], r"rollout.n = 0 must be >= 1: the group size is the number of samples per prompt"),
    (["--mode", "fast"], r"mode = 'fast' is not a mode: use one of consistent, baseline, both"),
    (["--rollout.max_model_len", "128"], r"rollout.max_model_len = 128 > model.max_position_embeddings = 64"),
    (["--quant", "fp9"], r"quant preset 'fp9' is unknown: use one of \('fp8', 'fp8_kv'"),
    (["--quant", "fp8+fp8"], r"quant preset 'fp8' sets linear.weight, which an earlier preset quantised already"),
])
def test_override_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_run_config(None, overrides)


@pytest.mark.parametrize("text, match", [
    ("rollout:\n  group_size: 4\n", r"unknown key rollout.group_size: valid keys of rollout are n, temperature"),
    ("trainer:\n  lr: 1\n", r"unknown config key 'trainer': valid keys are model, data"),
    ("train:\n  lr: 1\n  steps: [1, 2\nmode: both\n", r"{path}:\d+: invalid YAML"),
    ("- 1\n- 2\n", "a run config is a mapping"),
])
def test_bad_yaml_errors(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match.replace("{path}", str(path))):
        load_run_config(path, [])


def test_missing_yaml_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_config(tmp_path / "missing.yaml", [])


@pytest.mark.parametrize("make, match", [
    (lambda: RolloutSection(n=0), r"rollout.n = 0 must be >= 1"),
    (lambda: RolloutSection(temperature=-0.1), r"rollout.temperature = -0.1 must be a finite number >= 0: 0 decodes"),
    (lambda: TrainSection(val_temperature=float("inf")), r"train.val_temperature = inf must be a finite number >= 0"),
    (lambda: TrainSection(max_gen_batches=0), r"train.max_gen_batches = 0 must be >= 1"),
    (lambda: RolloutSection(env="tools"), r"rollout.tools = None is null but rollout.env = tools: name the toolbox"),
    (lambda: RolloutSection(tools="calculator"), r"rollout.tools = 'calculator' is set without rollout.env = tools"),
    (lambda: RolloutSection(env="tools", tools="calculator", tool_format="xml"),
     r"rollout.tool_format = 'xml' is not a tool-call format: use one of auto, hermes, llama3, deepseek"),
    (lambda: DataSection(chat_template=""), r"data.chat_template = '' is empty: give auto, none, or a template file"),
    (lambda: DataSection(chat_template_kwargs={"enable thinking": False}), r"data.chat_template_kwargs = .* must map"),
    (lambda: RolloutSection(top_p=1.5), r"rollout.top_p = 1.5 must be in \(0, 1\]"),
    (lambda: RolloutSection(max_tokens=64), r"rollout.max_tokens = 64 must be < rollout.max_model_len = 64"),
    (lambda: RolloutSection(num_blocks=3), r"rollout.num_blocks = 3 \* rollout.block_size = 16 is below"),
    (lambda: RolloutSection(max_num_batched_tokens=32), r"raise it or set rollout.prefill_chunk_size"),
    (lambda: TrainSection(lr=-1.0), r"train.lr = -1.0 must be a finite number > 0"),
    (lambda: TrainSection(betas=(0.9, 1.0)), r"train.betas = \(0.9, 1.0\) must both be in \[0, 1\)"),
    (lambda: TrainSection(log_every=0), r"train.log_every = 0 must be >= 1"),
    (lambda: WarmStartSection(steps=-1), r"warm_start.steps = -1 must be >= 0: 0 disables the warm start"),
    (lambda: ModelSection(num_key_value_heads=3), r"model.num_key_value_heads = 3 does not divide"),
    (lambda: ModelSection(model_type="gpt2"), r"model.model_type = 'gpt2' is not supported: use one of"),
    (lambda: DataSection(task="sudoku"), r"data.task = 'sudoku' is not an embedded task"),
    (lambda: DataSection(val_path="v.jsonl"), r"data.val_path = 'v.jsonl' is set but data.train_path is not"),
])
def test_validation_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_valid_edge_values():
    assert RolloutSection(max_num_batched_tokens=32, prefill_chunk_size=16).prefill_chunk_size == 16
    assert RolloutSection(temperature=0.0).temperature == 0.0 and TrainSection(val_temperature=0).val_temperature == 0
    cfg = load_run_config(None, ["--data.chat_template_kwargs", "{enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    assert DataSection(task="word_problems", train_path="t.parquet", val_path="v.parquet").val_path == "v.parquet"
    assert WarmStartSection(steps=0).steps == 0


def test_round_trip(tmp_path):
    cfg = load_run_config(None, ["--train.betas", "[0.8, 0.95]", "--train.lr", "1e-5", "--model.path", "ckpt/qwen",
                                 "--rollout.prefill_chunk_size", "16", "--mode", "both", "--out", "runs/x"])
    path = dump_yaml(cfg, tmp_path / "run" / "config.yaml")
    assert path.exists()
    assert load_run_config(path, []) == cfg
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["train"]["betas"] == [0.8, 0.95]
    assert "betas: [0.8, 0.95]" in path.read_text()



def test_parallel_layouts_are_config_keys():
    cfg = load_run_config(None, ["--parallel.rollout", "dp", "--parallel.trainer=fsdp"])
    assert (cfg.parallel.rollout, cfg.parallel.trainer) == ("dp", "fsdp")
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"parallel.trainer = 'zero3' is not a trainer layout: use one of single"):
        load_run_config(None, ["--parallel.trainer", "zero3"])
    with pytest.raises(ValueError, match=r"parallel.rollout = 'ep' splits the experts.*'qwen3' is dense"):
        load_run_config(None, ["--parallel.rollout", "ep"])


def test_engine_and_sampling_settings_come_from_the_rollout_section():
    cfg = load_run_config(None, ["--rollout.max_model_len", "48", "--rollout.temperature", "0.5",
                                 "--rollout.prefill_chunk_size", "16"])
    settings = engine_settings(cfg)
    assert settings["block_size"] == cfg.rollout.block_size == BLOCK_SIZE
    assert settings["scheduler"].max_model_len == 48 and settings["scheduler"].prefill_chunk_size == 16
    params = sampling_params(cfg, seed=3, max_tokens=2)
    assert (params.temperature, params.seed, params.max_tokens) == (0.5, 3, 2)


def test_every_shipped_config_loads():
    """Each YAML file under onepath/configs is a valid run config (on the CPU for the GPU ones: the check is
    of the keys and values, not of the device)."""
    for path in sorted(DEMO.parent.glob("*.yaml")):
        cfg = load_run_config(path, ["--device", "cpu"])
        assert cfg.out, path
