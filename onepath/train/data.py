"""Dataset rows in verl's format, their prompts as token ids, and the seeded prompt sampler.

A row: {"data_source": str, "prompt": [{"role", "content"}, ...] or str, "ability": str,
"reward_model": {"style": str, "ground_truth": ...}, "extra_info": dict}.

A chat-list prompt is rendered by the chat template (data.chat_template) with add_generation_prompt;
without one its contents are joined as they are (tasks/rows.prompt_text). A string prompt is taken as
already rendered, whatever the template.
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from onepath.chat.encoder import ChatEncoder
from onepath.chat.template import ChatTemplate, special_tokens
from onepath.tasks.rows import prompt_text

SUPPORTED = (".parquet", ".jsonl", ".json")


def load_rows(path) -> list[dict]:
    path = Path(path)
    if path.suffix not in SUPPORTED:
        raise ValueError(f"{path}: unsupported extension {path.suffix!r}; "
                         f"use one of {', '.join(SUPPORTED)}")
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} not found: check the path")
    if path.suffix == ".parquet":
        rows, lines = _read_parquet(path), None
    else:
        rows, lines = _read_json(path)
    if not rows:
        raise ValueError(f"{path} holds no rows: add rows or point to another file")
    for i, row in enumerate(rows):
        where = f"row {i} of {path}" + (f" (line {lines[i]})" if lines else "")
        _validate(row, where)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:  # an empty, cut-short or non-parquet file
        raise ValueError(f"dataset {path} is not a readable parquet file ({e}): write it again (pandas "
                         "DataFrame.to_parquet or pyarrow.parquet.write_table), or point to another file") from None


def _read_json(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"dataset {path} is not UTF-8 text (byte {e.start}): save it as UTF-8 JSON, "
                         "or as parquet with a .parquet name") from None
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text), None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    numbered = read_jsonl(path)
    return [row for _, row in numbered], [number for number, _ in numbered]


def read_jsonl(path: Path, cut_short_last: bool = False) -> list[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSON-lines file. cut_short_last: a last line that
    does not parse (what a run killed mid-write leaves) is dropped instead of refused."""
    lines = Path(path).read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as e:
            if cut_short_last and number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg}): {line[:80]!r}; "
                             "fix or delete the line") from None
    return records


def _validate(row, where: str):
    if not isinstance(row, dict):
        raise ValueError(f"{where} is a {type(row).__name__}, not an object: "
                         "each row must be a JSON object with prompt and reward_model")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError(f"{where} has no reward_model.ground_truth: "
                         f"add reward_model.ground_truth to {where}, or drop the row")
    prompt = row.get("prompt")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list)
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                for m in prompt))
    if not ok or not prompt_text(row):
        raise ValueError(f"{where} has a missing or empty prompt ({prompt!r}): give it a "
                         "non-empty string or a list of {'role': str, 'content': str} messages, "
                         "or drop the row")


def chat_template(choice: str, model_path: str | None, tokenizer_config: dict) -> ChatTemplate | None:
    """data.chat_template: auto (the checkpoint's, if it ships one; the embedded model has none), none,
    or a file (.jinja, or a tokenizer_config.json holding one)."""
    if choice == "none":
        return None
    if choice == "auto":
        template = ChatTemplate.from_checkpoint(model_path) if model_path else None
        return template.check() if template is not None else None
    return ChatTemplate.from_file(choice, special_tokens(tokenizer_config)).check()


class Prompts:
    """Rows' prompts as the model reads them: a chat list through the chat encoder (rendered with
    add_generation_prompt, encoded without added special tokens), anything else as prompt_text
    encoded with the tokenizer's own special tokens."""

    def __init__(self, tokenizer, chat: ChatEncoder | None = None):
        self.tokenizer, self.chat = tokenizer, chat

    def ids(self, row: dict) -> list[int]:
        if self.chat is not None and isinstance(row["prompt"], list):
            return self.chat.prompt_ids(row["prompt"])
        return self.tokenizer.encode(prompt_text(row)).ids

    def messages(self, row: dict) -> list[dict] | None:
        """The chat list an environment continues, or None for a string prompt."""
        return [dict(m) for m in row["prompt"]] if isinstance(row["prompt"], list) else None

    def describe(self) -> str:
        if self.chat is None:
            return "chat template: none; a chat-list prompt's contents are joined as they are (roles dropped)"
        return f"chat template: {self.chat.template.source} (prompts rendered with add_generation_prompt)"


def reward_kwargs(row: dict) -> dict:
    """The keyword arguments a reward function receives for this row."""
    others = {k: v for k, v in row.items() if k not in ("prompt", "reward_model")}
    return {**others,
            "ground_truth": row["reward_model"]["ground_truth"],
            "data_source": row.get("data_source"),
            "extra_info": row.get("extra_info") or {}}


class PromptSampler:
    """Rows in epochs, each a fresh shuffle fixed by (seed, epoch), so a resumed run continues
    the same sequence from (epoch, cursor)."""

    def __init__(self, rows: list[dict], seed: int = 0, shuffle: bool = True):
        if not rows:
            raise ValueError("PromptSampler got no rows: load a dataset with at least one row")
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            # A string seed hashes with sha512: the same order in every process and Python run.
            random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[dict]:
        batch = []
        while len(batch) < n:
            if self.cursor == len(self.order):
                self.epoch += 1
                self.cursor = 0
                self.order = self._order()
            take = min(n - len(batch), len(self.order) - self.cursor)
            batch += [self.rows[i] for i in self.order[self.cursor:self.cursor + take]]
            self.cursor += take
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "shuffle": self.shuffle, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict):
        if state["num_rows"] != len(self.rows):
            raise ValueError(f"sampler state is for {state['num_rows']} rows but the dataset has "
                             f"{len(self.rows)}: resume with the dataset the run started with")
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self.shuffle = state.get("shuffle", True)
        self.order = self._order()
