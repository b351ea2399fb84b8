"""onepath.ops.cuda.topk (index_topk) under Triton's CPU interpreter: the k best valid entries by the 64-bit key,
descending position, -1 last: the CPU path's (ops/topk.keyed_index_topk) positions exactly, on rows that cross
blocks, with planted ties (ReLU zeros, -0.0 beside +0.0, equal values across blocks), invalid entries, k above the
valid count and rows with none; a row alone equals it in a batch; other launch shapes (block, warps) select the
same. Control: torch.topk picks other tied entries."""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, print_checks

CHECKS = ["equals_keyed_topk", "planted_ties_to_the_larger_position", "any_block_same_positions", "fewer_valid_than_k",
          "rows_alone_equal_batch", "library_topk_differs_on_ties", "no_entries_yet"]


def _run_checks() -> dict:
    import torch

    from onepath.ops import topk as T
    from onepath.ops.cuda import topk

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    length = 2500  # three blocks of 1024, the last one partial
    scores = torch.randn(6, length, generator=gen)
    valid = torch.rand(6, length, generator=gen) < 0.9
    for k in (1, 7, 300):
        got, want = topk.index_topk(scores, valid, k), T.keyed_index_topk(scores, valid, k)
        record("equals_keyed_topk", torch.equal(got, want), f"k={k}")
    # ReLU scores: most entries exactly 0 (and -0.0), the boundary inside the zeros; equal values in every block
    ties = torch.relu(torch.randn(5, length, generator=gen)) * (torch.rand(5, length, generator=gen) < 0.3)
    ties[1] = -ties[1]
    ties[2, ::7] = 1.5
    ties[3] = torch.where(torch.rand(length, generator=gen) < 0.5, -0.0, 0.0)
    for k in (5, 400, 1200):
        got, want = topk.index_topk(ties, torch.ones_like(ties, dtype=torch.bool), k), T.keyed_index_topk(
            ties, torch.ones_like(ties, dtype=torch.bool), k)
        record("planted_ties_to_the_larger_position", torch.equal(got, want), f"k={k}")
        # the launch shape (block, warps) moves the time only: the bench's sweep picks among them
        for block, warps in ((256, 2), (2048, 8)):
            other = topk.index_topk(ties, torch.ones_like(ties, dtype=torch.bool), k, block, warps)
            record("any_block_same_positions", torch.equal(other, want), f"k={k} block {block} warps {warps}")
    library = T.library_index_topk(ties, torch.ones_like(ties, dtype=torch.bool), 400)
    record("library_topk_differs_on_ties", not torch.equal(library, T.keyed_index_topk(
        ties, torch.ones_like(ties, dtype=torch.bool), 400)), "torch.topk agreed with the key on planted ties")
    few = torch.rand(3, length, generator=gen) < 0.01
    few[2] = False
    got = topk.index_topk(scores[:3], few, 200)
    want = T.keyed_index_topk(scores[:3], few, 200)
    record("fewer_valid_than_k", torch.equal(got, want) and bool((got[2] == -1).all()), "")
    alone = torch.cat([topk.index_topk(scores[i:i + 1], valid[i:i + 1], 300) for i in range(6)])
    record("rows_alone_equal_batch", torch.equal(alone, topk.index_topk(scores, valid, 300)), "")
    # a context with no compressed entry yet: scores [..., 0], nothing to pick (ops.topk asks for min(k, 0))
    none = topk.index_topk(torch.zeros(2, 3, 0), torch.zeros(2, 3, 0, dtype=torch.bool), 0)
    record("no_entries_yet", none.shape == (2, 3, 0) and none.dtype == torch.int64, f"got {tuple(none.shape)}")
    return results


interpreted, test_index_topk_interpreted = interpreted_checks(__file__, "index_topk", CHECKS)

if __name__ == "__main__":
    print_checks(_run_checks)


def test_launch_shapes_cover_every_length():
    """Each row length gets the first shipped shape whose longest row covers it; the last covers any."""
    from onepath.ops.cuda import topk

    assert [topk.launch_shape(n) for n in (0, 1, 1024, 1025, 2048, 8192, 16384, 16385, 1 << 20)] == [
        (1024, 4), (1024, 4), (1024, 4), (2048, 8), (2048, 8), (4096, 8), (4096, 8), (8192, 16), (8192, 16)]


def test_kernel_builds_for_sm90():
    """The kernel as the GPU compiles it at each shipped launch shape (the interpreter runs code the compiler
    refuses, a constexpr assigned in a static loop for one): it builds for sm_90 within shared memory, and keeps
    its 64-bit position stores."""
    from onepath.ops.cuda import topk
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    sig = dict(s_ptr="*fp32", v_ptr="*i8", o_ptr="*i64", L="i32", K="i32", s_stride="i32", v_stride="i32",
               o_stride="i32")
    for _, block, warps in topk.LAUNCH_SHAPES:
        config = type("Launch", (), dict(num_warps=warps, num_stages=1))
        built = build_sm90(topk._index_topk_kernel, sig, dict(BLOCK=block, RADIX=topk.RADIX),
                           ("s_ptr", "v_ptr", "o_ptr"), config)
        assert built.metadata.shared <= SM90_SHARED_BYTES and "st.global" in built.asm["ptx"], (block, warps)
