"""Actor: the trainer's side of the policy. Its forward is the engine's model code and `ops`
(autograd wrappers give the backward), over whole sequences written to a private paged cache.

An update may run forward + backward per micro-batch of whole sequences (a token budget), summing
gradients, and may recompute each decoder layer's activations in backward (`recompute`). Neither
moves a forward bit: a sequence's log-probs do not depend on its batch (batch invariance), and a
recomputed layer runs the same kernels on the same inputs.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from onepath.engine.sampling_params import SamplingParams, sampling_tensors
from onepath.models.batch import ForwardBatch
from onepath.models.moe import RoutingRecorder
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.train.grpo import NonFiniteError


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

    @classmethod
    def join(cls, parts: list["Responses"]) -> "Responses":
        """The rows of several batches in order, padded to the widest."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.mask.shape[1] for p in parts)
        pad = lambda x: torch.nn.functional.pad(x, (0, width - x.shape[1]))
        routing = None if any(p.routing is None for p in parts) else [x for p in parts for x in p.routing]
        return cls([x for p in parts for x in p.prompt_ids], [x for p in parts for x in p.completion_ids],
                   [x for p in parts for x in p.params], torch.cat([pad(p.rollout_logprobs) for p in parts]),
                   torch.cat([pad(p.mask) for p in parts]), routing)

    def select(self, rows: list[int]) -> "Responses":
        """Responses rows[0], rows[1], ... of this batch; the width T stays."""
        return Responses([self.prompt_ids[i] for i in rows], [self.completion_ids[i] for i in rows],
                         [self.params[i] for i in rows], self.rollout_logprobs[rows], self.mask[rows],
                         None if self.routing is None else [self.routing[i] for i in rows])


class Actor:
    """One process's trainer: the optimizer steps the whole model (or FP32 copies of it). The parallel
    actors (train/parallel.py) change where the trained tensors live through the hooks below:
    reduce_gradients, clip, publish, to_full / to_local."""

    def __init__(self, model: DenseDecoder, block_size: int, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, warmup_steps: int = 0, recompute: bool = False,
                 master_dtype: torch.dtype | None = None):
        """master_dtype: the optimizer updates copies of the weights in this dtype (e.g. FP32 under a BF16
        model, where an Adam step below half an ulp would round away) and each step writes them, rounded
        once, into the model's weights: the forward, and so the contract, sees the model's dtype only."""
        self.model, self.ops, self.block_size = model, model.ops, block_size
        self.recompute = recompute
        self.names = [name for name, _ in model.named_parameters()]
        params = list(model.parameters())
        self.master = None
        if master_dtype is not None and any(p.dtype != master_dtype for p in params):
            self.master = [torch.nn.Parameter(p.detach().to(master_dtype).clone()) for p in params]
        self.hyper = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, warmup_steps=warmup_steps)
        self.trained = dict(zip(self.names, self.master if self.master is not None else params))
        self.optimizer, self.schedule = self.make_optimizer(list(self.trained.values()))
        self.max_grad_norm = max_grad_norm
        # with a list here, each forward appends its sequences' MoE routing [prompt + completion - 1, layers, k]
        self.routing: list[torch.Tensor] | None = None

    def make_optimizer(self, params: list[torch.Tensor]):
        h = self.hyper
        optimizer = torch.optim.AdamW(params, lr=h["lr"], betas=h["betas"], weight_decay=h["weight_decay"])
        warmup = h["warmup_steps"]
        # Adam's first steps move every weight by about lr whatever the gradient's size: ramp lr up
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        return optimizer, schedule

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
        cache = self.model.make_cache(num_blocks, self.block_size)
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
        temperature, top_k, top_p = sampling_tensors(row_params, device)
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
        self.model.zero_grad(set_to_none=True)
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
        self.reduce_gradients()
        trained = self.gradients_onto_trained()
        if grad_scale != 1.0:
            for p in trained:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        grad_norm = float(self.clip(trained))  # one sync a step: the norm must be known before the weights move
        if not math.isfinite(grad_norm):
            raise NonFiniteError(f"the gradient norm is {grad_norm}: the backward met a NaN or an overflow; the "
                                 "weights were left unchanged: lower train.lr and resume from the last checkpoint")
        self.optimizer.step()
        self.schedule.step()
        self.publish()
        return grad_norm

    def reduce_gradients(self) -> None:
        """Sum the gradients over the ranks that share the step's batch: none on one process."""

    def gradients_onto_trained(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, holding this step's gradients."""
        if self.master is None:
            return list(self.model.parameters())
        for p, m in zip(self.model.parameters(), self.master):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
            p.grad = None
        return self.master

    def clip(self, trained: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(trained, self.max_grad_norm)

    @torch.no_grad()
    def publish(self) -> None:
        """The stepped tensors into the model's weights (master weights rounded once)."""
        if self.master is not None:
            for p, m in zip(self.model.parameters(), self.master):
                p.copy_(m)

    @property
    def has_master(self) -> bool:
        return self.master is not None

    # Checkpoints hold full tensors per parameter name, whatever the layout that wrote them.
    def to_full(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of trained tensor `name` (or of its optimizer state) -> the full tensor."""
        return tensor

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The full tensor of `name` -> this rank's part."""
        return full

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights in the Hugging Face layout, whole."""
        return self.model.hf_state_dict()

    def optimizer_state(self) -> dict:
        """AdamW's state as full tensors per parameter name, the learning rate, the schedule."""
        per_name = {}
        for name, p in self.trained.items():
            state = self.optimizer.state.get(p)
            if state:
                per_name[name] = {k: v.detach().cpu().clone() if k == "step" else self.to_full(name, v).detach().cpu()
                                  for k, v in sorted(state.items())}
        return {"params": per_name, "lr": [g["lr"] for g in self.optimizer.param_groups],
                "schedule": self.schedule.state_dict()}

    def load_optimizer_state(self, saved: dict) -> None:
        for name, p in self.trained.items():
            if name in saved["params"]:
                self.optimizer.state[p] = {
                    k: v.clone() if k == "step" else self.to_local(name, v).to(device=p.device, dtype=p.dtype).clone()
                    for k, v in saved["params"][name].items()}
        for group, lr in zip(self.optimizer.param_groups, saved["lr"]):
            group["lr"] = lr
        self.schedule.load_state_dict(saved["schedule"])

    def master_state(self) -> dict[str, torch.Tensor] | None:
        if self.master is None:
            return None
        return {name: self.to_full(name, t).detach().cpu() for name, t in self.trained.items()}

    @torch.no_grad()
    def load_master_state(self, saved: dict[str, torch.Tensor]) -> None:
        for name, t in self.trained.items():
            t.copy_(self.to_local(name, saved[name]))
        self.publish()

    def update(self, loss: torch.Tensor) -> float:
        """One AdamW step on a loss whose graph is already built (the whole batch in one backward)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
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
