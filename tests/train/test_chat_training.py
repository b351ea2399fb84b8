"""Chat prompts in `onepath train`: verl rows whose prompt is a message list are rendered with the
checkpoint's template (add_generation_prompt), token for token what transformers' apply_chat_template
gives; data.chat_template none (and the embedded model, which has none) joins the contents, said in a
line; rollout.env tools trains on tool episodes with diff = 0. Greedy validation (train.val_temperature 0)
and greedy `onepath generate`. Misconfigurations fail in a line."""
import json

import pytest

from onepath.cli import main
from onepath.config import load_run_config
from onepath.numerics.diff import is_exact
from onepath.tasks.rows import prompt_text
from onepath.train.trainer import GRPOTrainer, prepare
from tests.chat_families import write_chat_checkpoint

ROWS = [{"data_source": "toy", "prompt": [{"role": "system", "content": "Answer with a number."},
                                          {"role": "user", "content": f"What is {i}+{i}?"}],
         "reward_model": {"style": "rule", "ground_truth": str(2 * i)}} for i in range(12)]


@pytest.fixture
def chat_run(tmp_path):
    """(checkpoint, data file, overrides) of a small chat run."""
    # the config's EOS is <|endoftext|>, as a base Qwen3's: a turn's <|im_end|> must come from the template
    ckpt = write_chat_checkpoint(tmp_path / "ckpt", "qwen3", eos="<|endoftext|>", max_position_embeddings=2048)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return ckpt, data, ["--model.path", str(ckpt), "--data.train_path", str(data), "--train.steps", "2",
                        "--train.prompts_per_step", "4", "--rollout.n", "2", "--rollout.max_tokens", "12",
                        "--rollout.max_model_len", "1536", "--rollout.num_blocks", "512",
                        "--rollout.max_num_batched_tokens", "2048"]


def setup_of(tmp_path, args):
    cfg = load_run_config(None, [*args, "--out", str(tmp_path / "run")])
    return cfg, prepare(cfg, tmp_path / "run", progress=False)


def test_chat_prompts_are_rendered_as_transformers_renders_them(tmp_path, chat_run, capsys):
    from transformers import AutoTokenizer
    ckpt, _, args = chat_run
    cfg, setup = setup_of(tmp_path, args)
    assert f"chat template: {ckpt / 'tokenizer_config.json'}" in capsys.readouterr().out
    hf = AutoTokenizer.from_pretrained(ckpt)
    for row in ROWS[:3]:
        want = hf.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert setup.prompts.ids(row) == want
    trainer = GRPOTrainer(cfg, "consistent", setup, tmp_path / "run" / "consistent")
    assert trainer.params(1).stop_token_ids == (setup.tokenizer.token_to_id("<|im_end|>"),)
    history = trainer.run(progress=False)
    assert all(is_exact(m) for m in history)


def test_chat_template_none_and_the_embedded_model_join_the_contents(tmp_path, chat_run, capsys):
    _, _, args = chat_run
    _, setup = setup_of(tmp_path, [*args, "--data.chat_template", "none"])
    assert "chat template: none; a chat-list prompt's contents are joined as they are" in capsys.readouterr().out
    assert setup.prompts.ids(ROWS[0]) == setup.tokenizer.encode(prompt_text(ROWS[0])).ids
    _, setup = setup_of(tmp_path, ["--warm_start.steps", "0", "--data.n_train", "8", "--data.n_test", "0"])
    assert "(the embedded model has none)" in capsys.readouterr().out and setup.prompts.chat is None


def test_a_template_file(tmp_path, chat_run):
    _, _, args = chat_run
    path = tmp_path / "short.jinja"
    path.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    _, setup = setup_of(tmp_path, [*args, "--data.chat_template", str(path)])
    text = setup.tokenizer.decode(setup.prompts.ids(ROWS[1]), skip_special_tokens=False)
    assert text == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 1+1?<|im_end|>\n"
                    "<|im_start|>assistant\n")


@pytest.mark.slow
def test_tool_episodes_train_with_diff_zero(tmp_path, chat_run):
    _, _, args = chat_run
    cfg, setup = setup_of(tmp_path, [*args, "--rollout.env", "tools", "--rollout.tools", "calculator",
                                     "--rollout.max_turns", "3", "--rollout.max_tokens", "16"])
    history = GRPOTrainer(cfg, "consistent", setup, tmp_path / "run" / "consistent").run(progress=False)
    assert all(is_exact(m) and m["rollout_corr/valid_tokens"] > 0 for m in history)
    assert any(m["episode/turns/mean"] > 1 for m in history)
    assert all(m["response_length/mean"] == m["episode/policy_tokens/mean"] for m in history)


def test_greedy_validation_does_not_depend_on_the_seed(tmp_path):
    common = ["--warm_start.steps", "30", "--data.n_train", "16", "--data.n_test", "8", "--out", str(tmp_path)]

    def validation(*extra):
        cfg = load_run_config(None, [*common, *extra])
        t = GRPOTrainer(cfg, "consistent", prepare(cfg, tmp_path, progress=False), tmp_path / "v")
        return [{k: v for k, v in t.validate(step).items() if k != "timing_s/val"} for step in (1, 2)]

    greedy = validation("--train.val_temperature", "0")
    assert greedy[0] == greedy[1]                    # a new step's seed, the same greedy answers
    sampled = validation("--train.val_temperature", "1.0")
    assert sampled[0] != sampled[1]                  # control: sampling follows the seed


def test_greedy_generate(tmp_path, capsys):
    ckpt = write_chat_checkpoint(tmp_path / "ckpt", "qwen3")
    lines = []
    for seed in ("1", "2"):
        assert main(["generate", str(ckpt), "What is 2+2?", "--rollout.temperature", "0", "--rollout.seed", seed,
                     "--rollout.max_tokens", "8", "--rollout.max_model_len", "64"]) == 0
        lines.append(capsys.readouterr().out)
    assert lines[0] == lines[1] and "'What is 2+2?' ->" in lines[0]


@pytest.mark.parametrize("extra, match", [
    (["--rollout.temperature", "0"], r"rollout.temperature = 0 decodes greedily: every sample of a group"),
    (["--data.chat_template", "none", "--data.chat_template_kwargs", "{enable_thinking: false}"],
     r"data.chat_template_kwargs = \{'enable_thinking': False\} but no chat template is in use"),
    (["--data.chat_template", "missing.jinja"], r"chat template missing.jinja does not exist"),
    (["--data.chat_template", "none", "--rollout.env", "tools", "--rollout.tools", "calculator"],
     r"rollout.env = tools needs a chat template"),
])
def test_misconfigurations_fail_in_a_line(tmp_path, chat_run, capsys, extra, match):
    _, _, args = chat_run
    assert main(["train", *args, *extra, "--out", str(tmp_path / "bad"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    import re
    assert re.search(match, err), err


def test_tools_need_chat_list_prompts_and_a_template_that_keeps_turns(tmp_path, chat_run, capsys):
    ckpt, data, args = chat_run
    data.write_text(json.dumps({**ROWS[0], "prompt": "What is 1+1?"}) + "\n")
    assert main(["train", *args, "--rollout.env", "tools", "--rollout.tools", "calculator", "--out",
                 str(tmp_path / "a"), "--quiet"]) == 2
    assert "prompt row 0 is a string" in capsys.readouterr().err
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert main(["train", *args, "--rollout.env", "tools", "--rollout.tools", "calculator",
                 "--data.chat_template_kwargs", "{enable_thinking: false}", "--out", str(tmp_path / "b"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot keep episodes token in, token out with tool messages" in err and err.count("\n") == 1
