"""embedding: a row gather; exact on every backend, so one implementation serves every (mode, device) (KERNELS).

padding_idx (the checkpoint's pad_token_id) changes no value; as in transformers' nn.Embedding, the lookups of
that row add nothing to its gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from onepath.numerics.spec import ExecutionSpec
from onepath.ops.host import capturing


def embedding(spec: ExecutionSpec, token_ids: torch.Tensor, weight: torch.Tensor,
              padding_idx: int | None = None) -> torch.Tensor:
    vocab = weight.shape[0]
    if token_ids.numel() and not capturing(token_ids) and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab):
        bad = token_ids[(token_ids < 0) | (token_ids >= vocab)][0].item()
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab}): check the tokenizer matches the model")
    return KERNELS[spec.mode, spec.device](token_ids, weight, padding_idx)


# (mode, device) -> kernel(token_ids, weight, padding_idx): the gather moves bits, it computes nothing
KERNELS = dict.fromkeys([("consistent", "cpu"), ("consistent", "cuda"), ("baseline", "cpu"), ("baseline", "cuda")],
                        F.embedding)
