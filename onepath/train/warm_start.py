"""Supervised warm start: teach the tiny model the task's answer format so RL has signal at step 1.

This is initialisation, not part of the compared path: it runs the baseline ops and a plain
cross-entropy loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from onepath.models.batch import ForwardBatch
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import BLOCK_SIZE


def warm_start(model: DenseDecoder, examples: list[tuple[list[int], list[int]]], steps: int, batch_size: int,
               lr: float, seed: int, block_size: int = BLOCK_SIZE, progress: bool = True) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    losses = []
    for _ in tqdm(range(steps), desc="warm start", disable=not progress, leave=False):
        picks = torch.randint(0, len(examples), (batch_size,), generator=g).tolist()
        pairs = [examples[i] for i in picks]
        batch, num_blocks, rows = ForwardBatch.for_completions([p for p, _ in pairs], [c for _, c in pairs], block_size,
                                                               model.device)
        hidden = model(batch, model.make_cache(num_blocks, block_size))
        targets = [t for _, c in pairs for t in c]
        loss = F.cross_entropy(model.compute_logits(hidden[rows]).float(), torch.tensor(targets, device=model.device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses
