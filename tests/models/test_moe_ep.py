"""Expert parallelism over torch.distributed (gloo, 1, 2 and 4 processes): a token's log-probs have
the same bits under every EP degree and either expert layout, and as in one process without EP, so an
engine at EP a and a trainer at EP b agree. Each rank holds only its experts and its share of the
sequences; the all-to-alls move rows, the merge runs on the token's rank in slot order; quantised experts
(block-FP8, NVFP4 W4A4) keep it too. Negative
controls: a merge in another order must show a difference under EP, and the baseline backend must move a
row's bits with the batch (a one-token sequence alone against the batch: the one row size at which every CPU
GEMM measured takes another kernel)."""
import datetime
import os
import pickle
import socket
from queue import Empty

import pytest
import torch
import torch.distributed as dist

from onepath.models import moe
from onepath.models.batch import ForwardBatch
from onepath.models.kv_cache import KVCache
from tests.tiny import random_prompts, tiny_moe_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(workers, queue):
    """The result one worker puts on `queue`, then every worker joined. Read before the join completes
    (a put larger than the pipe waits for its reader); join raises a worker's error at once."""
    while True:
        try:
            result = queue.get(timeout=1)
            break
        except Empty:
            assert not workers.join(timeout=0), "the workers ended without results"
    while not workers.join():
        pass
    return result


TOP_K = 4  # three adds per token: a merge order other than slot order changes bits
# few tokens, so under 16 pairs an expert: the baseline GEMM picks another kernel for a chunk of 16
SEQUENCES = random_prompts(torch.Generator().manual_seed(3), 5, low=1, high=9)
BOUNDS = {1: [0, 37], 2: [0, 37, 37], 4: [0, 10, 30, 37, 37]}  # block rows per rank: the last has none
SLOT_SUM = moe.slot_sum
GRAD_WEIGHTS = torch.randn(37, 48, generator=torch.Generator().manual_seed(6))
# (mode, dtype, merge, quant): quantised experts (block-FP8, NVFP4 W4A4) run grouped on their stacked weights
CASES = [("consistent", "float32", "slot", None), ("consistent", "bfloat16", "slot", None),
         ("consistent", "float32", "reversed", None), ("consistent", "bfloat16", "slot", "fp8"),
         ("consistent", "float32", "slot", "nvfp4_w4a4")]


def model_for(mode: str, dtype: str, quant: str | None = None):
    return tiny_moe_model(mode, dtype=dtype, num_experts_per_tok=TOP_K, quant=quant)


def logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's [n, 1 + vocab]: at every position the log-prob of the next token (the last one
    wraps to the first: any token of the sequence will do), then the whole logits row, so that a
    one-ULP move anywhere shows."""
    batch, blocks = ForwardBatch.for_sequences(sequences, 16, model.device)
    cache = KVCache(model.config, blocks, 16, model.ops.spec.dtype, model.device)
    with torch.no_grad():
        logits = model.compute_logits(model(batch, cache))
        targets = torch.tensor([t for s in sequences for t in s[1:] + s[:1]])
        lp, _ = model.ops.token_logprobs(logits, targets, torch.ones(len(targets)))
    return list(torch.cat([lp[:, None], logits], 1).split([len(s) for s in sequences]))


def reversed_slot_sum(x):
    acc = x[:, -1]
    for j in range(x.shape[1] - 2, -1, -1):
        acc = acc + x[:, j]
    return acc


def worker(rank: int, world: int, port: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a rank that fails leaves its peers waiting in a collective: let them give up
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        degrees = [ep for ep in (1, 2, 4) if ep <= world]
        groups = {ep: [dist.new_group(list(range(g, g + ep))) for g in range(0, world, ep)] for ep in degrees}
        results = {}
        for mode, dtype, merge, quant in CASES:
            moe.slot_sum = SLOT_SUM if merge == "slot" else reversed_slot_sum
            for ep in degrees:
                group = groups[ep][rank // ep]
                for layout in ("masked", "contiguous"):
                    model = model_for(mode, dtype, quant).expert_parallel(group)
                    for block in model.modules():
                        if isinstance(block, moe.SparseMoeBlock):
                            block.layout = layout
                    mine = list(range(len(SEQUENCES)))[rank % ep::ep]
                    lps = logprobs(model, [SEQUENCES[i] for i in mine])
                    results[mode, dtype, merge, quant, ep, layout, rank] = dict(zip(mine, lps))
            moe.slot_sum = SLOT_SUM
        # one block, the tokens split unevenly, the last rank with none: it still serves its experts
        block = model_for("consistent", "float32").expert_parallel().model.layers[0].mlp
        x = torch.randn(37, 48, generator=torch.Generator().manual_seed(5))
        bounds = BOUNDS[world]
        with torch.no_grad():
            results["block", rank] = (bounds[rank], block(x[bounds[rank]:bounds[rank + 1]]))
        # the backward runs the all-to-alls in reverse: a trainer at EP > 1 gets each token's gradient
        mine = x[bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
        (block(mine) * GRAD_WEIGHTS[bounds[rank]:bounds[rank + 1]]).sum().backward()
        results["grad", rank] = (bounds[rank], block.experts.first, mine.grad, block.experts.gate_up_proj.grad,
                                 block.experts.down_proj.grad, block.gate.weight.grad)
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        if rank == 0:
            # plain pickle copies the tensors' data: the queue's own would share memory this process frees
            queue.put(pickle.dumps({k: v for part in gathered for k, v in part.items()}))
        dist.barrier()  # nobody leaves while another rank still talks to it
    finally:
        dist.destroy_process_group()


def run(world: int) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = torch.multiprocessing.start_processes(worker, args=(world, free_port(), queue), nprocs=world,
                                                    join=False, start_method="spawn")
    return pickle.loads(collect(workers, queue))


@pytest.fixture(scope="module")
def reference() -> dict:
    """One process, no EP, every sequence in one forward (the trainer's contiguous layout)."""
    return {(mode, dtype, quant): logprobs(model_for(mode, dtype, quant), SEQUENCES) for mode, dtype, _, quant in CASES}


def per_sequence(results: dict, case: tuple, ep: int, layout: str) -> list[torch.Tensor]:
    merged = {}
    for key, lps in results.items():
        if key[:4] == case and key[4:6] == (ep, layout):
            merged.update(lps)
    return [merged[i] for i in range(len(SEQUENCES))]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_ep_degree_and_layout_gives_the_bits_of_one_process(world, reference):
    results = run(world)
    pairs = [(ep, layout) for ep in (1, 2, 4) if ep <= world for layout in ("masked", "contiguous")]
    for mode, dtype, merge, quant in CASES:
        ref = reference[mode, dtype, quant]
        case = (mode, dtype, merge, quant)
        same = [all(torch.equal(a, b) for a, b in zip(per_sequence(results, case, *p), ref)) for p in pairs]
        if mode == "consistent" and merge == "slot":
            assert all(same), (case, dict(zip(pairs, same)))
            # engine at EP a vs trainer at EP b: every pairing of (degree, layout) agrees
            for a in pairs:
                for b in pairs:
                    assert all(map(torch.equal, per_sequence(results, case, *a), per_sequence(results, case, *b))), (a, b)
        else:  # negative control: another merge order moves bits
            assert not all(same), case
    block = model_for("consistent", "float32").model.layers[0].mlp
    x = torch.randn(37, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = block(x)
    parts = [results["block", r] for r in range(world)]
    assert world == 1 or len(parts[-1][1]) == 0
    for start, out in parts:
        assert torch.equal(out, full[start:start + len(out)])
    check_gradients(block, x, [results["grad", r] for r in range(world)])


def check_gradients(block, x, parts):
    """Each rank's input gradient, its experts' weight gradients and, summed over ranks (the
    data-parallel all-reduce), the router's gradient equal one process's (backward is correct, not bitwise)."""
    x = x.clone().requires_grad_()
    (block(x) * GRAD_WEIGHTS).sum().backward()
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    router = torch.zeros_like(block.gate.weight)
    for start, first, x_grad, gate_up, down, router_grad in parts:
        close(x_grad, x.grad[start:start + len(x_grad)])
        close(gate_up, block.experts.gate_up_proj.grad[first:first + len(gate_up)])
        close(down, block.experts.down_proj.grad[first:first + len(down)])
        router += router_grad
    close(router, block.gate.weight.grad)


def test_a_row_alone_keeps_its_bits_in_the_batch_and_the_baseline_moves_them():
    """The single-process half of the claim, with the baseline's negative control: the first token of a
    sequence has the same logits alone as among the batch's 37 tokens (consistent), not so with the stock GEMM."""
    probe = [SEQUENCES[0][:1]]
    for mode in ("consistent", "baseline"):
        model = model_for(mode, "float32")
        alone, batch = logprobs(model, probe)[0][0], logprobs(model, probe + SEQUENCES)[0][0]
        assert torch.equal(alone, batch) == (mode == "consistent"), mode


def test_ep_degree_must_divide_the_experts(monkeypatch):
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(ValueError, match="num_experts 8 is not a multiple of the EP degree 3"):
        moe.ExpertParallel.over(8)
