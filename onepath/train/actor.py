"""Actor: the trainer's side of the policy. Its forward is the engine's model code and `ops`
(autograd wrappers give the backward), over whole sequences written to a private paged cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onepath.engine.sampling_params import SamplingParams
from onepath.models.batch import ForwardBatch
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

    @classmethod
    def build(cls, prompt_ids, completion_ids, params, logprobs) -> "Responses":
        width = max((len(c) for c in completion_ids), default=0)
        lp = torch.zeros(len(completion_ids), width)
        mask = torch.zeros(len(completion_ids), width, dtype=torch.bool)
        for i, values in enumerate(logprobs):
            lp[i, :len(values)] = torch.tensor(values, dtype=torch.float32)
            mask[i, :len(values)] = True
        return cls(prompt_ids, completion_ids, params, lp, mask)


class Actor:
    def __init__(self, model: DenseDecoder, block_size: int, lr: float, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 max_grad_norm: float = 1.0, warmup_steps: int = 0):
        self.model, self.ops, self.block_size = model, model.ops, block_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        # Adam's first steps move every weight by about lr whatever the gradient's size: ramp lr up
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0)
        self.max_grad_norm = max_grad_norm

    def logprobs(self, r: Responses) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies [B, T] of the completion tokens under the sampling distributions."""
        device = self.model.device
        batch, num_blocks, rows = ForwardBatch.for_completions(r.prompt_ids, r.completion_ids, self.block_size, device)
        cache = KVCache(self.model.config, num_blocks, self.block_size, self.ops.spec.dtype, device)
        hidden = self.model(batch, cache)
        tokens = [t for c in r.completion_ids for t in c]
        owners = [i for i, c in enumerate(r.completion_ids) for _ in c]
        logits = self.model.compute_logits(hidden[rows])
        temperature = torch.tensor([r.params[i].temperature for i in owners], dtype=torch.float32, device=device)
        top_k = torch.tensor([r.params[i].top_k for i in owners], dtype=torch.long, device=device)
        top_p = torch.tensor([r.params[i].top_p for i in owners], dtype=torch.float32, device=device)
        with torch.no_grad():
            keep = self.ops.sampling_mask(logits.detach(), temperature, top_k, top_p)
        tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        lp, entropy = self.ops.token_logprobs(logits, tokens, temperature, keep)
        mask = r.mask.to(device)
        return self.scatter(lp, mask), self.scatter(entropy, mask)

    @staticmethod
    def scatter(values, mask):
        out = values.new_zeros(mask.shape)
        return out.masked_scatter(mask, values) if values.numel() else out

    def update(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.schedule.step()
        return float(grad_norm)
