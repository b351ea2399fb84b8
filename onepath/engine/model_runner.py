"""ModelRunner: turns a scheduled step into one forward pass over the paged KV cache, then samples."""
from __future__ import annotations

import torch

from onepath.engine.scheduler import ScheduledSeq
from onepath.engine.sequence import Sequence
from onepath.models.batch import ForwardBatch, SeqChunk
from onepath.models.dense import DenseDecoder
from onepath.models.kv_cache import KVCache
from onepath.ops.sampling import sample_key


class ModelRunner:
    def __init__(self, model: DenseDecoder, num_blocks: int, block_size: int):
        self.model, self.ops = model, model.ops
        self.block_size = block_size
        self.cache = KVCache(model.config, num_blocks, block_size, model.ops.spec.dtype, model.device)

    @torch.no_grad()
    def run(self, scheduled: list[ScheduledSeq]) -> dict[int, tuple[int, float]]:
        chunks = [SeqChunk(s.seq.token_ids[s.start:s.start + s.num_tokens], s.start, s.seq.block_table)
                  for s in scheduled]
        batch = ForwardBatch.build(chunks, self.block_size, self.model.device)
        hidden = self.model(batch, self.cache)
        last = batch.last_token_rows()
        rows = [int(last[i]) for i, s in enumerate(scheduled) if s.samples]
        seqs = [s.seq for s in scheduled if s.samples]
        if not seqs:
            return {}
        return self.sample(seqs, self.model.compute_logits(hidden[rows]))

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> dict[int, tuple[int, float]]:
        """Draw each sequence's next token and its log-probability under the distribution it was drawn
        from: softmax(logits / temperature) restricted to top-k / top-p and renormalised."""
        device = logits.device
        temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long, device=device)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
        keep = self.ops.sampling_mask(logits, temperature, top_k, top_p)
        probs = self.ops.probs(logits, temperature, keep)
        keys = [sample_key(s.params.seed, s.request_id, s.num_tokens) for s in seqs]
        tokens = self.ops.sample(probs, keys)
        logprobs, _ = self.ops.token_logprobs(logits, tokens, temperature, keep)
        return {s.request_id: (t, lp) for s, t, lp in zip(seqs, tokens.tolist(), logprobs.tolist())}
