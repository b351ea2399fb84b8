"""Token ids to the text a response shows: incremental decoding for streams, per-token strings for
log-probs, and the part of a turn that may be streamed as content while tool calls are still being written.
"""
from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from onepath.chat.tool_calls import DS_CALL_BEGIN, DS_CALLS_BEGIN, PYTHON_TAG

MARKERS = {"hermes": ("<tool_call>",), "deepseek": (DS_CALLS_BEGIN, DS_CALL_BEGIN)}


class IncrementalText:
    """The text of a growing list of token ids, handed out in pieces whose concatenation is the decode of
    the whole (a piece waits while its last bytes are an incomplete UTF-8 character). skip: token ids left
    out of the text (a chat turn's end-of-turn token). The pieces come from tokenizers' DecodeStream: one call
    into the tokenizer a token, over its own window of earlier tokens (docs/serve.md: its cost)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, skip: tuple[int, ...] = ()):
        self.tokenizer, self.skip = tokenizer, set(skip)
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        pieces = []
        for t in token_ids:
            if t not in self.skip:
                self.ids.append(t)
                piece = self.stream.step(self.tokenizer, t)
                if piece:
                    pieces.append(piece)
        piece = "".join(pieces)
        self.text += piece
        return piece


class TokenStrings:
    """Each token's own text and UTF-8 bytes, as OpenAI's logprobs entries show them."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def entry(self, token_id: int, logprob: float) -> dict:
        text = self.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}


def streamable_content(text: str, fmt: str | None) -> str:
    """The content a stream may show while the turn is still written: the text before the first tool call
    (none of a marker's first characters, nor the whitespace the parsed content strips), a prefix of what
    parse(text, fmt).content will be."""
    if fmt == "llama3":  # a call is the whole turn: a turn that may still become one shows nothing
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return ""
        return text.strip()
    cut = len(text)
    for marker in MARKERS.get(fmt, ()):
        at = text.find(marker)
        if at >= 0:
            cut = min(cut, at)
        for k in range(len(marker) - 1, 0, -1):  # a marker's first characters at the end may be one
            if text[:cut].endswith(marker[:k]):
                cut = min(cut, len(text[:cut]) - k)
                break
    return text[:cut].strip()
