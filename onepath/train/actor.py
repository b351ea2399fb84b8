"""Actor: the trainer's side of the policy. Its forward is the engine's model code and `ops`
(autograd wrappers give the backward), over whole sequences written to a private paged cache.

An update may run forward + backward per micro-batch of whole sequences (a token budget), summing
gradients, and may recompute each decoder layer's activations in backward (`recompute`). Neither
moves a forward bit: a sequence's log-probs do not depend on its batch (batch invariance), and a
recomputed layer runs the same kernels on the same inputs.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from onepath.engine.sampling_params import SamplingParams
from onepath.models.batch import ForwardBatch
from onepath.models.moe import RoutingRecorder
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache


@dataclass(slots=True)
class Responses:
    """Prompt/completion token ids of one step's responses and the engine's log-probs, padded to [B, T]."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    params: list[SamplingParams]
    rollout_logprobs: torch.Tensor   # [B, T] FP32, 0 where mask is False
    mask: torch.Tensor               # [B, T] bool: valid completion tokens
    routing: list[torch.Tensor | None] | None = None  # the engine's MoE routing per sequence (RequestOutput.routing)

    @classmethod
    def build(cls, prompt_ids, completion_ids, params, logprobs) -> "Responses":
        width = max((len(c) for c in completion_ids), default=0)
        lp = torch.zeros(len(completion_ids), width)
        mask = torch.zeros(len(completion_ids), width, dtype=torch.bool)
        for i, values in enumerate(logprobs):
            lp[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
            mask[i, :len(values)] = True
        return cls(prompt_ids, completion_ids, params, lp, mask)

    def select(self, rows: list[int]) -> "Responses":
        """Responses rows[0], rows[1], ... of this batch; the width T stays."""
        return Responses([self.prompt_ids[i] for i in rows], [self.completion_ids[i] for i in rows],
                         [self.params[i] for i in rows], self.rollout_logprobs[rows], self.mask[rows],
                         None if self.routing is None else [self.routing[i] for i in rows])


class Actor:
    def __init__(self, model: DenseDecoder, block_size: int, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, warmup_steps: int = 0, recompute: bool = False,
                 master_dtype: torch.dtype | None = None):
        """master_dtype: the optimizer updates copies of the weights in this dtype (e.g. FP32 under a BF16
        model, where an Adam step below half an ulp would round away) and each step writes them, rounded
        once, into the model's weights: the forward, and so the contract, sees the model's dtype only."""
        self.model, self.ops, self.block_size = model, model.ops, block_size
        self.recompute = recompute
        params = list(model.parameters())
        self.master = None
        if master_dtype is not None and any(p.dtype != master_dtype for p in params):
            self.master = [torch.nn.Parameter(p.detach().to(master_dtype).clone()) for p in params]
        trained = self.master if self.master is not None else params
        self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        # Adam's first steps move every weight by about lr whatever the gradient's size: ramp lr up
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0)
        self.max_grad_norm = max_grad_norm
        # with a list here, each forward appends its sequences' MoE routing [prompt + completion - 1, layers, k]
        self.routing: list[torch.Tensor] | None = None

    def logprobs(self, r: Responses, max_tokens: int | None = None,
                 head_rows: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [B, T] of the completion tokens under the sampling distributions.

        Sequences run in micro-batches of at most `max_tokens` tokens and the LM head in chunks of
        `head_rows` rows, so FP32 logits never exist for the whole batch; neither split moves a bit."""
        lps, entropies = [], []
        for group in self.micro_batches(r, max_tokens):
            lp, entropy = self.forward([r.prompt_ids[i] for i in group], [r.completion_ids[i] for i in group],
                                       [r.params[i] for i in group], head_rows)
            lps.append(lp)
            entropies.append(entropy)
        mask = r.mask.to(self.model.device)
        return self.scatter(torch.cat(lps), mask), self.scatter(torch.cat(entropies), mask)

    @staticmethod
    def micro_batches(r: Responses, max_tokens: int | None) -> list[list[int]]:
        groups, size = [[]], 0
        for i, (p, c) in enumerate(zip(r.prompt_ids, r.completion_ids)):
            n = len(p) + len(c)
            if max_tokens and groups[-1] and size + n > max_tokens:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        return groups

    def forward(self, prompts, completions, params, head_rows):
        device = self.model.device
        batch, num_blocks, rows = ForwardBatch.for_completions(prompts, completions, self.block_size, device)
        cache = KVCache.for_model(self.model, num_blocks, self.block_size)
        if self.routing is None:
            hidden = self.hidden(batch, cache)
        else:
            with RoutingRecorder(self.model) as recorder:  # left before backward: a recompute is not recorded
                hidden = self.hidden(batch, cache)
            choices = recorder.take()
            cu = list(map(int, batch.attn.cu_seqlens))
            self.routing += [choices[a:b] for a, b in zip(cu, cu[1:])]
        tokens = [t for c in completions for t in c]
        row_params = [params[i] for i, c in enumerate(completions) for _ in c]
        return self.head(hidden, rows, tokens, row_params, head_rows)

    def hidden(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """The model's forward; with `recompute` and grad on, each decoder layer under activation
        checkpointing: its activations are freed after the forward and rebuilt in backward."""
        if self.recompute and torch.is_grad_enabled():
            return self.model(batch, cache, layer_fn=recomputed)
        return self.model(batch, cache)

    def head(self, hidden, rows: list[int], tokens: list[int], row_params: list[SamplingParams],
             head_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of tokens[i] from hidden[rows[i]] under row_params[i]'s sampling
        distribution, the LM head run in chunks of head_rows rows."""
        device = hidden.device
        tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        temperature = torch.tensor([p.temperature for p in row_params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k for p in row_params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in row_params], dtype=torch.float32, device=device)
        lps, entropies = [], []
        for a in range(0, len(rows), head_rows):
            b = min(a + head_rows, len(rows))
            logits = self.model.compute_logits(hidden[rows[a:b]])
            with torch.no_grad():
                keep = self.ops.sampling_mask(logits.detach(), temperature[a:b], top_k[a:b], top_p[a:b])
            lp, entropy = self.ops.token_logprobs(logits, tokens[a:b], temperature[a:b], keep)
            lps.append(lp)
            entropies.append(entropy)
        if not lps:
            return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
        return torch.cat(lps), torch.cat(entropies)

    @staticmethod
    def scatter(values, mask):
        out = values.new_zeros(mask.shape)
        return out.masked_scatter(mask, values) if values.numel() else out

    def backward(self, r: Responses, loss_fn: Callable, micro_batch_tokens: int | None = None,
                 forward: Callable | None = None, timer: Callable | None = None,
                 forward_phase: str = "update") -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Fresh gradients of the step's loss over r, by forward + backward per micro-batch of whole
        sequences of at most micro_batch_tokens tokens (None or 0: one micro-batch), summed.

        loss_fn(rows, logprobs) -> (loss, stats) is the share of the step's loss of r.select(rows),
        whose log-probs [len(rows), T] carry grad; it must normalise as the whole batch does (a
        token-mean over the whole step's tokens), so that the shares add up to the step's loss.
        forward(responses) -> (logprobs, entropies) defaults to self.logprobs. timer(name) times the
        forwards as forward_phase and the losses and backwards as "update".
        Returns the log-probs and entropies [B, T] (detached) and each stat summed over micro-batches."""
        forward = forward or self.logprobs
        timer = timer or (lambda name: nullcontext())
        self.optimizer.zero_grad(set_to_none=True)
        lps, entropies, totals = [], [], {}
        for rows in self.micro_batches(r, micro_batch_tokens):  # consecutive rows, in order
            with timer(forward_phase):
                lp, entropy = forward(r.select(rows))
            with timer("update"):
                loss, stats = loss_fn(rows, lp)
                loss.backward()
            lps.append(lp.detach())
            entropies.append(entropy.detach())
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        return torch.cat(lps), torch.cat(entropies), totals

    def step(self, grad_scale: float = 1.0) -> float:
        """Scale the gradients by grad_scale (when not 1), clip them, take one AdamW step; the norm before
        clipping. With master weights the gradients move onto them first, and the stepped masters are
        rounded into the model's weights."""
        trained = list(self.model.parameters())
        if self.master is not None:
            for p, m in zip(trained, self.master):
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
                p.grad = None
            trained = self.master
        if grad_scale != 1.0:
            for p in trained:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, self.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        if self.master is not None:
            with torch.no_grad():
                for p, m in zip(self.model.parameters(), self.master):
                    p.copy_(m)
        return float(grad_norm)

    def update(self, loss: torch.Tensor) -> float:
        """One AdamW step on a loss whose graph is already built (the whole batch in one backward)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self.step()


def recomputed(layer, x, *rest):
    """layer(x, *rest) under activation checkpointing. The hidden state is the checkpoint's only
    input: the forward writes this step's K/V into the cache in place, and a saved input must not
    change before backward; recomputing writes the same bits again (same kernels, same inputs).
    A recompute would silently use weights changed since the forward, so it checks their versions
    as the autograd wrappers' saved tensors do without recompute."""
    params = list(layer.parameters())
    versions = [p._version for p in params]

    def run(h):
        if [p._version for p in params] != versions:
            raise RuntimeError("a decoder layer's weights were modified in place between its forward and its "
                               "backward (train.recompute rebuilds the layer from the weights as they are now): "
                               "run the optimizer step after backward")
        return layer(h, *rest)

    return checkpoint(run, x, use_reentrant=False)
