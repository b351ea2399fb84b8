"""Tensor parallelism over torch.distributed (gloo, 2 and 4 processes): a token's logits and log-probs
have the TP=1 bits at TP 2 and 4, dense and MoE, FP32 and BF16, in the model's forward and through the
engine (prefill, decode, sampling), so a rollout at TP 2 and a trainer at TP 1 agree. Negative control:
the stock row-parallel reduction (a K shard per rank, partial sums all-reduced) moves bits on the same
case. The premise on the CPU, measured: a GEMM column's bits do not depend on the launch's width from
MIN_CPU_COLUMNS columns on, and do below (why narrower shards are refused)."""
import datetime
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from onepath.engine.llm_engine import LLMEngine
from onepath.engine.sampling_params import SamplingParams
from onepath.engine.scheduler import SchedulerConfig
from onepath.models.tensor_parallel import MIN_CPU_COLUMNS, check_tensor_parallel
from onepath.numerics.spec import ExecutionSpec
from onepath.ops import Ops
from onepath.models.batch import ForwardBatch
from onepath.models.dense import DenseDecoder
from tests.models.test_moe_ep import collect, free_port
from tests.tiny import random_prompts, tiny_config, tiny_model, tiny_moe_config, tiny_moe_model

SEQUENCES = random_prompts(torch.Generator().manual_seed(11), 5, low=1, high=23)
MOE = dict(moe_intermediate_size=64)  # 16 SwiGLU columns a rank at TP 4
# (model, dtype, reduce): reduce all_reduce is the stock row-parallel layer, the negative control
CASES = [("dense", "float32", "gather"), ("dense", "bfloat16", "gather"), ("moe", "float32", "gather"),
         ("moe", "bfloat16", "gather"), ("dense", "float32", "all_reduce"), ("moe", "float32", "all_reduce")]
PARAMS = SamplingParams(temperature=1.0, max_tokens=9, seed=5)


class StackingOps(Ops):
    """q/k/v and gate/up stacked into one GEMM each, as on CUDA: the engine then makes the layers' weights
    views of one stacked tensor, which the weight sync must find."""

    def can_stack(self, sizes):
        return True


def model_for(kind: str, dtype: str, tied: bool = False):
    if kind == "dense":
        model = tiny_model("consistent", tie_word_embeddings=tied)
        return model.to(getattr(torch, dtype)) if dtype != "float32" else model
    return tiny_moe_model("consistent", dtype=dtype, tie_word_embeddings=tied, **MOE)


def stacked_tied(seed: int = 0) -> DenseDecoder:
    model = DenseDecoder(tiny_config(tie_word_embeddings=True), StackingOps(ExecutionSpec.default("consistent", "cpu")))
    model.init_weights(seed, std=0.15)
    return model


def logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's [n, 1 + vocab]: the log-prob of the next token at every position, then the whole
    logits row, so that a one-ULP move anywhere shows."""
    batch, blocks = ForwardBatch.for_sequences(sequences, 16, model.device)
    cache = model.make_cache(blocks, 16)  # a TP rank's cache holds its KV heads
    with torch.no_grad():
        logits = model.compute_logits(model(batch, cache))
        targets = torch.tensor([t for s in sequences for t in s[1:] + s[:1]])
        lp, _ = model.ops.token_logprobs(logits, targets, torch.ones(len(targets)))
    return list(torch.cat([lp[:, None], logits.float()], 1).split([len(s) for s in sequences]))


def engine_outputs(model) -> list[tuple[list[int], list[float]]]:
    engine = LLMEngine(model, num_blocks=64, block_size=16, scheduler=SchedulerConfig(max_model_len=64))
    return [(o.token_ids, o.logprobs) for o in engine.generate(SEQUENCES, PARAMS)]


def send_to_parent(results: dict, rank: int, world: int, queue) -> None:
    """Every rank's results, gathered, put on the parent's queue by rank 0."""
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        queue.put(pickle.dumps(gathered))
    dist.barrier()


def worker(rank: int, world: int, port: int, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results = {}
        for kind, dtype, reduce in CASES:
            model = model_for(kind, dtype).tensor_parallel(reduce=reduce)
            results[kind, dtype, reduce] = logprobs(model, SEQUENCES)
        # tied embeddings: the head's shard is a copy of the embedding's rows, written again at each sync
        tied = stacked_tied().tensor_parallel()
        results["tied"] = logprobs(tied, SEQUENCES)
        other = stacked_tied(seed=7)
        # the engine's storage sharing first: the sync must find the tensors the forward reads
        tied.share_projection_storage()
        targets = dict(tied.named_parameters())
        with torch.no_grad():
            for name, full in other.named_parameters():
                tied.tp.write(name, full) if name in tied.tp.copies else targets[name].copy_(full)
        results["tied-synced"] = logprobs(tied, SEQUENCES)
        # the engine: prefill, decode steps and sampling on every rank, the KV cache holding the rank's heads
        results["engine", "dense"] = engine_outputs(model_for("dense", "float32").tensor_parallel())
        results["engine", "moe"] = engine_outputs(model_for("moe", "float32").tensor_parallel())
        send_to_parent(results, rank, world, queue)
    finally:
        dist.destroy_process_group()


def run(world: int) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = torch.multiprocessing.start_processes(worker, args=(world, free_port(), queue), nprocs=world,
                                                    join=False, start_method="spawn")
    return pickle.loads(collect(workers, queue))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_gives_the_bits_of_one_process(world):
    ranks = run(world)
    for kind, dtype, reduce in CASES:
        reference = logprobs(model_for(kind, dtype), SEQUENCES)
        for rank, results in enumerate(ranks):
            if reduce == "gather":
                assert same(results[kind, dtype, reduce], reference), (kind, dtype, world, rank)
            else:  # negative control: partial sums all-reduced move bits
                assert not same(results[kind, dtype, reduce], reference), (kind, dtype, world, rank)
    assert all(same(results["tied"], logprobs(stacked_tied(), SEQUENCES)) for results in ranks)
    assert all(same(results["tied-synced"], logprobs(stacked_tied(seed=7), SEQUENCES)) for results in ranks)
    for kind in ("dense", "moe"):
        expected = engine_outputs(model_for(kind, "float32"))
        assert any(len(tokens) > 1 for tokens, _ in expected)
        for results in ranks:
            assert results["engine", kind] == expected, kind


def test_cpu_gemm_columns_keep_their_bits_from_the_minimum_width():
    """The premise of column sharding on the CPU: a column's bits in an n-column launch are its bits in
    the full layer's for every n >= MIN_CPU_COLUMNS at any offset; narrower launches take other bits."""
    g = torch.Generator().manual_seed(2)
    for k in (48, 136, 1000):
        x, w = torch.randn(16, k, generator=g), torch.randn(300, k, generator=g)
        full = F.linear(x, w)
        for n in (MIN_CPU_COLUMNS, 17, 34, 68, 151):
            for start in (0, 5, 300 - n):
                assert torch.equal(F.linear(x, w[start:start + n].clone()), full[:, start:start + n]), (k, n, start)
        narrow = [n for n in range(1, 12) if not torch.equal(F.linear(x, w[:n].clone()), full[:, :n])]
        assert narrow, k  # the narrow kernel: the reason a narrower CPU shard is refused


def test_a_tp_degree_without_the_guarantee_is_refused():
    cpu = ExecutionSpec.default("consistent", "cpu")
    check_tensor_parallel(tiny_config(), cpu, 4)
    with pytest.raises(ValueError, match=r"parallel.tp = 3 does not divide the 4 attention heads"):
        check_tensor_parallel(tiny_config(), cpu, 3)
    with pytest.raises(ValueError, match=r"moe_intermediate_size / 4 10 columns wide.*narrower than 16"):
        check_tensor_parallel(tiny_moe_config(moe_intermediate_size=40), cpu, 4)
    with pytest.raises(ValueError, match=r"does not divide intermediate_size = 100"):
        check_tensor_parallel(tiny_config(num_attention_heads=8, num_key_value_heads=8, intermediate_size=100), cpu, 8)
    with pytest.raises(ValueError, match=r"TP degree must divide the KV heads or be a multiple"):
        check_tensor_parallel(tiny_config(num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                          intermediate_size=144), cpu, 2)
    for quant in ("nvfp4_w4a4", "fp8"):
        with pytest.raises(ValueError, match=r"quantised linear weights or activations.*not yet proved"):
            check_tensor_parallel(tiny_config(), ExecutionSpec.default("consistent", "cuda", quant=quant), 2)
    check_tensor_parallel(tiny_config(), ExecutionSpec.default("consistent", "cuda", quant="fp8_kv"), 2)
    hybrid = tiny_config()
    hybrid.model_type = "nemotron_h"  # the check reads the architecture's name first
    with pytest.raises(ValueError, match=r"implemented for .* not nemotron_h"):
        check_tensor_parallel(hybrid, cpu, 2)


def gpu_worker(rank: int, world: int, port: int, queue):
    """On CUDA (NCCL, a GPU a rank): the consistent Triton kernels sharded, against the same model unsharded on
    each rank's own GPU; the stock all-reduce as the control; the engine's tokens and log-probs."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    try:
        cpu = lambda lps: [t.cpu() for t in lps]  # noqa: E731
        reference = tiny_model("consistent", device="cuda")
        results = {"one": cpu(logprobs(reference, SEQUENCES)), "engine-one": engine_outputs(reference)}
        for reduce in ("gather", "all_reduce"):
            results[reduce] = cpu(logprobs(tiny_model("consistent", device="cuda").tensor_parallel(reduce=reduce),
                                           SEQUENCES))
        results["engine"] = engine_outputs(tiny_model("consistent", device="cuda").tensor_parallel())
        send_to_parent(results, rank, world, queue)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_on_two_gpus_gives_the_bits_of_one():
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    workers = torch.multiprocessing.start_processes(gpu_worker, args=(2, free_port(), queue), nprocs=2, join=False,
                                                    start_method="spawn")
    for results in pickle.loads(collect(workers, queue)):
        assert same(results["gather"], results["one"])
        assert not same(results["all_reduce"], results["one"])  # negative control
        assert results["engine"] == results["engine-one"]
