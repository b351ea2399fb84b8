"""The chat families the chat tests run on: their template (tests/data/chat_templates, written after the
published ones), special tokens, and a small byte-level BPE tokenizer trained here on chat-like text,
with the family's control tokens as added tokens, as the real tokenizers have them."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

FAMILIES = {
    "qwen3": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>"),
    "llama3": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        added=[], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None),
    "llama3.1": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"],
        added=[], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None),
    "deepseek_v3": dict(
        special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                 "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"],
        added=["<think>", "</think>"], bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad=None),
}
FAMILIES["llama3.2"] = FAMILIES["llama3.1"]
FAMILIES["deepseek_r1"] = FAMILIES["deepseek_v3"]

CORPUS = [
    "You are a helpful assistant. What is the weather in Paris today? It is sunny, 21 degrees.",
    'Call a function: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "The answer is 42. Let me think step by step: 6 * 7 = 42, so the result is 42.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nEnvironment: ipython",
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n```json\n{}\n```",
    '{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}',
    "error: the tool raised ZeroDivisionError: division by zero. Sum = 12; 3 + 4 = 7.",
]


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text("utf-8")


@lru_cache(maxsize=None)
def tokenizer(family: str, vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE tokenizer (every string encodes) with the family's control tokens."""
    f = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=f["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in f["added"]])
    return tok


def tokenizer_config(family: str, template: str | None = None) -> dict:
    f = FAMILIES[family]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "chat_template": template_text(template or family)}
    config.update({f"{k}_token": f[k] for k in ("bos", "eos", "pad") if f[k] is not None})
    return config


def hf_tokenizer(family: str, template: str | None = None):
    """transformers' tokenizer over the same tokenizer object: the reference apply_chat_template."""
    from transformers import PreTrainedTokenizerFast
    config = tokenizer_config(family, template)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer(family), chat_template=config["chat_template"],
                                   **{k: v for k, v in config.items() if k.endswith("_token")})


CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


@lru_cache(maxsize=None)
def char_tokenizer(family: str) -> Tokenizer:
    """One token per printable ASCII character and newline, then the family's control tokens: a policy's
    sampled tokens decode and encode back to themselves, so an episode can equal its conversation exactly."""
    from tokenizers import Regex
    f = FAMILIES[family]
    vocab = {t: i for i, t in enumerate(["<unk>"] + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in f["special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in f["added"]])
    return tok


def write_chat_checkpoint(path, family: str, template: str | None = None, seed: int = 0, eos: str | None = None,
                          **config):
    """A tiny random qwen3-architecture checkpoint with the character tokenizer and the family's template;
    eos: the config's EOS token (default the template's end of turn)."""
    from onepath.models.checkpoint import save_checkpoint
    from tests.tiny import tiny_model
    tok = char_tokenizer(family)
    eos = tok.token_to_id(eos or FAMILIES[family]["eos"])
    model = tiny_model("baseline", seed=seed, vocab_size=tok.get_vocab_size(), eos_token_id=eos, **config)
    save_checkpoint(path, model.hf_state_dict(), model.config, tok, tokenizer_config(family, template))
    return path
