"""The Mamba-2 mixer's Triton kernels (ops/cuda/ssd.py, conv1d.py, rmsnorm.gated_rmsnorm) under Triton's CPU
interpreter, on tiny shapes that cross the scan's chunks (Q = 8 < BLOCK_Q), the row blocks and the head_dim blocks,
and a chunk of 40 that crosses the scan's column blocks.

The scan: a token's output and the state after it are the kernel's same bits in a whole prefill, a chunked prefill
cut off the chunks, decode (one token a pass, replaying the open chunk from the slot), the trainer's forward (no
state) and beside other sequences in other phases, FP32 and BF16, FP32 and BF16 states; values within FP32
tolerance of a float64 token-by-token loop written here. Controls: baseline's stock paths move bits on the same
cases; a slot whose open chunk is altered moves the decoded bits (the replay reads it). conv1d and the gated norm
likewise. The checks run in a subprocess (tests/interpret.py); the bits of Hopper's arithmetic are
tests/ops/test_ssd_gpu.py's job.
"""
from __future__ import annotations

from tests.interpret import check_recorder, interpreted_checks, patch_gemm_interpreter, print_checks

CHECKS = ["discretise_is_softplus_and_limits", "ssd_values_match_a_float64_loop",
          "ssd_bfloat16_values_near_a_float64_loop", "ssd_every_phase_gives_the_same_bits",
          "ssd_column_blocks_every_phase", "ssd_a_sequence_has_its_bits_beside_others", "ssd_bfloat16_every_phase", "ssd_a_reused_slot_starts_afresh",
          "ssd_control_stock_paths_move_bits", "ssd_control_the_replay_reads_the_slot", "conv1d_values",
          "conv1d_every_phase_gives_the_same_bits", "conv1d_control_the_state_is_read", "gated_rmsnorm_values",
          "gated_rmsnorm_rows_alone_equal_rows_in_batch"]
Q = 8


def _run_checks() -> dict:
    patch_gemm_interpreter()
    import torch
    import torch.nn.functional as F

    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops import conv1d as CONV
    from onepath.ops import rmsnorm as RN
    from onepath.ops import ssd as SSD
    from onepath.ops.cuda import conv1d as kconv
    from onepath.ops.cuda import rmsnorm as knorm
    from onepath.ops.cuda import ssd as kssd
    from onepath.ops.spans import SeqSpans
    from tests.ops.test_ssd import loop

    gen = torch.Generator().manual_seed(0)
    results, record = check_recorder()
    limit = (0.0, float("inf"))

    def shapes(h=4, p=6, g=2, n=8):
        return dict(h=h, p=p, g=g, n=n)

    def params(s):
        return (torch.log(1 + 7 * torch.rand(s["h"], generator=gen)), torch.randn(s["h"], generator=gen),
                torch.randn(s["h"], generator=gen) * 0.5 - 0.5)  # A_log, D, dt_bias

    def tokens(s, t, dtype=torch.float32):
        return [v.to(dtype) if k != 1 else v for k, v in enumerate((
            torch.randn(t, s["h"], s["p"], generator=gen), torch.randn(t, s["h"], generator=gen),
            torch.randn(t, s["g"], s["n"], generator=gen), torch.randn(t, s["g"], s["n"], generator=gen)))]

    def state(s, dtype=torch.float32, state_dtype=torch.float32, slots=2):
        return SSD.SSDState.empty(slots, s["h"], s["p"], s["g"], s["n"], Q, dtype, state_dtype)

    def passes(kernel, inputs, p, cuts, st, slot=1, state_dtype=torch.float32, dt_limit=limit):
        outs = [kernel(*(v[a:b] for v in inputs), *p, SeqSpans((0, b - a), (a,), (slot,)), st, Q, dt_limit,
                       state_dtype) for a, b in zip(cuts, cuts[1:])]
        return torch.cat(outs)

    def triton_ssd(*args):
        return kssd.ssd(*args)

    def stock_ssd(spec):
        def run(x, dt, B, C, A_log, D, dt_bias, spans, st, chunk, dt_limit, state_dtype):
            return SSD.stock(x, dt, B, C, A_log, D, dt_bias, spans=spans, state=st, chunk=chunk, dt_limit=dt_limit,
                             state_dtype=state_dtype)
        return run

    # discretise: softplus (threshold 20) and the limits, on values from -30 to 60
    v = torch.linspace(-30, 60, 97)[:, None].repeat(1, 3)
    bias = torch.tensor([0.0, -1.5, 2.0])
    for lim in (limit, (0.01, 0.5)):
        got = kssd.discretised(v, bias, lim)
        want = F.softplus((v + bias).double()).clamp(*lim).float()
        ok = torch.allclose(got, want, rtol=2e-6, atol=0)
        record("discretise_is_softplus_and_limits", ok, f"limits {lim}: max rel {((got - want) / want).abs().max()}")

    # the scan against a float64 loop: lengths across chunk and row-block boundaries, P over two head_dim blocks
    for s, t, lim in ((shapes(), 1, limit), (shapes(), Q + 1, limit), (shapes(), 3 * Q + 5, (0.05, 0.6)),
                      (shapes(h=2, p=70, g=1, n=5), 2 * Q + 3, limit)):
        p, inputs = params(s), tokens(s, t)
        y = triton_ssd(*inputs, *p, SeqSpans((0, t), (0,)), None, Q, lim, torch.float32)
        st = state(s)
        passes(triton_ssd, inputs, p, [0, t], st, dt_limit=lim)
        want, want_state = loop(inputs, p, dt_limit=lim)
        ok = torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
        record("ssd_values_match_a_float64_loop", ok, f"{s} T={t}: max |d| {(y.double() - want).abs().max()}")
        after = SSD.state_after(st, 1, t, p[0])  # the CPU formula over the kernel's boundary state and open chunk
        ok = torch.allclose(after.double(), want_state, rtol=1e-5, atol=1e-5)
        record("ssd_values_match_a_float64_loop", ok, f"{s} T={t}: state after, max |d| "
               f"{(after.double() - want_state).abs().max()}")

    # BF16 inputs: the FP32 dot operands go in as hi + lo, so y and the state keep near FP32's precision against the
    # float64 loop on the same (BF16) inputs; control: one rounding to BF16 (split=False, mamba-ssm's way) is far worse
    for s, t in ((shapes(), 3 * Q + 5), (shapes(h=2, p=70, g=1, n=20), 2 * Q + 3)):
        p, inputs = params(s), tokens(s, t, torch.bfloat16)
        want, want_state = loop(inputs, p)
        errors = {}
        for split in (True, False):
            st = state(s, torch.bfloat16)
            y = kssd.ssd(*inputs, *p, SeqSpans((0, t), (0,), (1,)), st, Q, limit, torch.float32, split=split)
            after = SSD.state_after(st, 1, t, p[0])
            errors[split] = (float((y.double() - want).abs().max() / want.abs().max()),
                             float((after.double() - want_state).abs().max() / want_state.abs().max()))
        ok = max(errors[True]) < 2e-5 and errors[False][0] > 20 * errors[True][0]
        record("ssd_bfloat16_values_near_a_float64_loop", ok, f"{s} T={t}: relative max error (y, state) split "
               f"{errors[True]}, one rounding {errors[False]}")

    cuts = {Q - 1: [0, 2, 3, Q - 1], Q + 1: [0, Q - 1, Q + 1], 3 * Q + 5: [0, 3, 5, 13, 14, 2 * Q, 3 * Q + 5]}

    def every_phase(s, t, dtype, state_dtype):
        p, inputs = params(s), tokens(s, t, dtype)
        trainer = triton_ssd(*inputs, *p, SeqSpans((0, t), (0,)), None, Q, limit, state_dtype)
        out, states = {}, {}
        for name, cut in (("whole", [0, t]), ("chunked", cuts[t]), ("decode", list(range(t + 1)))):
            states[name] = state(s, dtype, state_dtype)
            out[name] = passes(triton_ssd, inputs, p, cut, states[name], state_dtype=state_dtype)
        m = t % Q
        for name in ("whole", "chunked", "decode"):
            yield name, torch.equal(out[name], trainer), "output"
            a, b = states[name], states["whole"]
            yield name, torch.equal(a.ssm[1], b.ssm[1]), "boundary state"
            yield name, all(torch.equal(getattr(a, k)[1, :m], getattr(b, k)[1, :m]) for k in ("x", "dt", "B")), \
                "open chunk"

    for t in cuts:
        for name, ok, what in every_phase(shapes(), t, torch.float32, torch.float32):
            record("ssd_every_phase_gives_the_same_bits", ok, f"T={t} {name}: {what} differs from the trainer's")
    for t in (3 * Q + 5,):
        for state_dtype in (torch.float32, torch.bfloat16):
            for name, ok, what in every_phase(shapes(), t, torch.bfloat16, state_dtype):
                record("ssd_bfloat16_every_phase", ok, f"T={t} state {state_dtype} {name}: {what} differs")

    # a chunk of 40: two blocks of the scan's columns (BLOCK_S 32, the second partial), three row blocks, the
    # chunk padded to 64; every phase the trainer's bits, values against the float64 loop, FP32 and BF16
    wide, t = 40, 87
    s = shapes(h=2, p=6, g=1, n=8)
    for dtype in (torch.float32, torch.bfloat16):
        p, inputs = params(s), tokens(s, t, dtype)
        trainer = kssd.ssd(*inputs, *p, SeqSpans((0, t), (0,)), None, wide, limit, torch.float32)
        want, _ = loop(inputs, p)
        ok = torch.allclose(trainer.double(), want, rtol=2e-5, atol=2e-5)
        record("ssd_column_blocks_every_phase", ok, f"{dtype}: max |d| {(trainer.double() - want).abs().max()}")
        for name, cut in (("whole", [0, t]), ("chunked", [0, 5, 33, 40, 41, 70, t]), ("decode", list(range(t + 1)))):
            st = SSD.SSDState.empty(2, s["h"], s["p"], s["g"], s["n"], wide, dtype, torch.float32)
            out = torch.cat([kssd.ssd(*(v[a:e] for v in inputs), *p, SeqSpans((0, e - a), (a,), (1,)), st, wide,
                                      limit, torch.float32) for a, e in zip(cut, cut[1:])])
            record("ssd_column_blocks_every_phase", torch.equal(out, trainer), f"{dtype} {name} differs")

    # three sequences in one pass, each in another phase: a fresh prompt, a chunk from mid-chunk, one decode token
    s = shapes()
    p = params(s)
    lengths, starts = (11, 6, 1), (0, 13, 21)
    seqs = [tokens(s, a + n) for a, n in zip(starts, lengths)]
    alone, shared = [], state(s, slots=3)
    for i, (a, n, inputs) in enumerate(zip(starts, lengths, seqs)):
        own = state(s, slots=3)
        alone.append(passes(triton_ssd, inputs, p, [0, a, a + n] if a else [0, n], own, slot=0)[a:])
        if a:
            passes(triton_ssd, inputs, p, [0, a], shared, slot=i)
    batch = [torch.cat([v[a:a + n] for a, n, v in zip(starts, lengths, (q[k] for q in seqs))]) for k in range(4)]
    cu = (0, 11, 17, 18)
    out = triton_ssd(*batch, *p, SeqSpans(cu, starts, (0, 1, 2)), shared, Q, limit, torch.float32)
    for i in range(3):
        record("ssd_a_sequence_has_its_bits_beside_others", torch.equal(out[cu[i]:cu[i + 1]], alone[i]),
               f"sequence {i} (start {starts[i]}, {lengths[i]} tokens)")

    # a slot that held another sequence: a new one from position 0 gets the bits of a fresh slot
    inputs, other = tokens(s, 13), tokens(s, 21)
    reused = state(s)
    passes(triton_ssd, other, p, [0, 21], reused)
    got = passes(triton_ssd, inputs, p, [0, 5, 6, 13], reused)
    fresh = passes(triton_ssd, inputs, p, [0, 5, 6, 13], state(s))
    record("ssd_a_reused_slot_starts_afresh", torch.equal(got, fresh), "a reused slot leaks its old state")

    # controls: the stock paths (baseline) on the same cases move bits; an altered open chunk moves the replay
    base = stock_ssd(ExecutionSpec(mode="baseline"))
    moved = 0
    for t in cuts:
        p, inputs = params(s), tokens(s, t)
        whole = passes(base, inputs, p, [0, t], state(s))
        moved += not torch.equal(passes(base, inputs, p, list(range(t + 1)), state(s)), whole)
        moved += not torch.equal(passes(base, inputs, p, cuts[t], state(s)), whole)
    record("ssd_control_stock_paths_move_bits", moved >= 4, f"only {moved} of 6 stock runs moved bits")
    t = 2 * Q + 5
    p, inputs = params(s), tokens(s, t)
    st = state(s)
    passes(triton_ssd, inputs, p, [0, t - 1], st)
    clean = passes(triton_ssd, inputs, p, [t - 1, t], SSD.SSDState(st.ssm.clone(), st.x.clone(), st.dt.clone(),
                                                                    st.B.clone()))
    st.x[1, 2] *= 1 + 2 ** -10  # an ulp-sized change can round away in one token's few terms
    altered = passes(triton_ssd, inputs, p, [t - 1, t], st)
    record("ssd_control_the_replay_reads_the_slot", not torch.equal(clean, altered),
           "decode ignored a change in the slot's open chunk")

    # conv1d: K = 4 taps, C = 300 channels (two blocks), the ring state across passes
    c, k = 300, 4
    w, bias = torch.randn(c, k, generator=gen) * 0.5, torch.randn(c, generator=gen)

    def conv_passes(x, cut, ring, b=bias):
        return torch.cat([kconv.causal_conv1d(x[a:e], w, b, SeqSpans((0, e - a), (a,), (1,)), ring)
                          for a, e in zip(cut, cut[1:])])

    for t, cut in ((1, [0, 1]), (3, [0, 2, 3]), (17, [0, 3, 4, 11, 17])):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(t, c, generator=gen).to(dtype)
            for b in (bias, None):
                trainer = kconv.causal_conv1d(x, w, b, SeqSpans((0, t), (0,)), None)
                want = CONV.reference(x.float(), w, b, SeqSpans((0, t), (0,)))
                ok = torch.allclose(trainer.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
                record("conv1d_values", ok, f"T={t} {dtype} bias={b is not None}")
                rings = {name: torch.zeros(2, k - 1, c, dtype=dtype) for name in ("whole", "chunked", "decode")}
                outs = {name: conv_passes(x, ct, rings[name], b) for name, ct in
                        (("whole", [0, t]), ("chunked", cut), ("decode", list(range(t + 1))))}
                for name in outs:
                    record("conv1d_every_phase_gives_the_same_bits", torch.equal(outs[name], trainer)
                           and torch.equal(rings[name], rings["whole"]), f"T={t} {dtype} {name}")
    x = torch.randn(9, c, generator=gen)
    ring = torch.zeros(2, k - 1, c)
    conv_passes(x, [0, 8], ring)
    kept = ring.clone()
    cpu_ring = torch.zeros(2, k - 1, c)
    CONV.consistent(x[:8], w, bias, SeqSpans((0, 8), (0,), (1,)), cpu_ring)
    record("conv1d_every_phase_gives_the_same_bits", torch.equal(kept, cpu_ring), "the ring differs from the CPU's")
    decoded = conv_passes(x, [8, 9], ring)
    zeroed = conv_passes(x, [8, 9], torch.zeros(2, k - 1, c))
    record("conv1d_control_the_state_is_read", not torch.equal(decoded, zeroed), "decode ignored the ring")

    # gated rmsnorm: groups of 40 (I = 160, four groups) and of 1100 (over a BLOCK)
    for width, group in ((160, 40), (2200, 1100)):
        for dtype in (torch.float32, torch.bfloat16):
            x, z = torch.randn(5, width, generator=gen), torch.randn(5, width, generator=gen) * 2
            wt = (torch.randn(width, generator=gen) * 0.3 + 1).to(dtype)
            got = knorm.gated_rmsnorm(x, z, wt, 1e-5, group)
            want = RN.gated_reference(x, z, wt, 1e-5, group)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
            record("gated_rmsnorm_values", got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol),
                   f"I={width} group={group} {dtype}")
            for m in (1, 3, 7):
                pos = int(torch.randint(m, (1,), generator=gen))
                bx, bz = torch.randn(m, width, generator=gen), torch.randn(m, width, generator=gen)
                bx[pos], bz[pos] = x[2], z[2]
                record("gated_rmsnorm_rows_alone_equal_rows_in_batch",
                       torch.equal(knorm.gated_rmsnorm(bx, bz, wt, 1e-5, group)[pos], got[2]), f"M={m} pos={pos}")
    return results


interpreted, test_ssd_interpreted = interpreted_checks(__file__, "ssd", CHECKS)


if __name__ == "__main__":
    print_checks(_run_checks)


def test_mixer_kernels_build_for_sm90():
    """What the launchers pick at Nemotron-3-Nano's mixer shape builds for the H200 (sm_90, no GPU needed), within
    its shared memory: the scan on tensor cores for BF16 inputs (the FP32 operands' hi and lo dots both kept), on
    FMAs for FP32 (IEEE dots, no TF32); the conv,
    the gated norm, dt's discretisation and the open chunk's store."""
    from onepath.ops.cuda import conv1d, rmsnorm, ssd
    from tests.interpret import SM90_SHARED_BYTES, build_sm90

    class Launch:
        num_warps, num_stages, enable_fp_fusion = ssd.NUM_WARPS, 3, False

    ints = ("x_t", "x_h", "b_t", "b_g", "c_t", "c_g", "y_t", "y_h", "ssm_slot", "ssm_h", "ssm_p", "sx_slot", "sx_q",
            "sx_h", "sdt_slot", "sdt_q", "sb_slot", "sb_q", "sb_g", "H", "P", "N", "Q", "HEADS_PER_GROUP")
    block_p, block_n, block_q = ssd.blocks(64, 128, 128)
    for dtype, state, has_state in (("bf16", "fp32", True), ("fp32", "bf16", False)):  # the engine's; the trainer's
        sig = dict(x_ptr=f"*{dtype}", dt_ptr="*fp32", B_ptr=f"*{dtype}", C_ptr=f"*{dtype}", A_log_ptr="*fp32",
                   D_ptr="*fp32", y_ptr="*fp32", cu_ptr="*i64", start_ptr="*i64", slot_ptr="*i64", ssm_ptr=f"*{state}",
                   sx_ptr=f"*{dtype}", sdt_ptr="*fp32", sB_ptr=f"*{dtype}", **{n: "i32" for n in ints})
        consts = dict(HAS_STATE=has_state, BLOCK_L=ssd.BLOCK_L, BLOCK_Q=block_q, BLOCK_P=block_p, BLOCK_N=block_n,
                      BLOCK_S=ssd.BLOCK_S, SPLIT=dtype == "bf16")
        built = build_sm90(ssd._ssd_scan_kernel, sig, consts, (), Launch)
        ptx = built.asm["ptx"]
        assert built.metadata.shared <= SM90_SHARED_BYTES, (dtype, built.metadata.shared)
        on_tensor_cores = "mma.sync" in ptx or "wgmma" in ptx
        assert on_tensor_cores == (dtype == "bf16"), dtype
        if dtype == "bf16":  # the split's hi and lo dots are both there: more MMAs than one rounding's build
            single = build_sm90(ssd._ssd_scan_kernel, sig, dict(consts, SPLIT=False), (), Launch).asm["ptx"]
            mmas = lambda text: text.count("mma.sync") + text.count("wgmma.mma_async")
            assert mmas(ptx) > mmas(single) > 0, (mmas(ptx), mmas(single))
    keep_ints = ("x_t", "x_h", "b_t", "b_g", "sx_slot", "sx_q", "sx_h", "sdt_slot", "sdt_q", "sb_slot", "sb_q", "sb_g",
                 "H", "P", "G", "N", "Q")
    build_sm90(ssd._keep_open_chunk_kernel, dict(
        x_ptr="*bf16", dt_ptr="*fp32", B_ptr="*bf16", row_seq_ptr="*i64", cu_ptr="*i64", start_ptr="*i64",
        slot_ptr="*i64", sx_ptr="*bf16", sdt_ptr="*fp32", sB_ptr="*bf16", **{n: "i32" for n in keep_ints}),
        dict(BLOCK=ssd.BLOCK_ROW, BLOCK_H=64), (), Launch)
    build_sm90(ssd._discretise_kernel, dict(dt_ptr="*bf16", bias_ptr="*bf16", out_ptr="*fp32", dt_stride="i32",
                                            H="i32", lo="fp32", hi="fp32"), dict(BLOCK=64), (), Launch)
    conv_ints = ("x_stride", "out_stride", "state_slot_stride", "state_row_stride", "C")
    for has_state in (True, False):
        build_sm90(conv1d._conv_kernel, dict(
            x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", out_ptr="*bf16", state_ptr="*bf16", row_seq_ptr="*i64",
            cu_ptr="*i64", start_ptr="*i64", slot_ptr="*i64", **{n: "i32" for n in conv_ints}),
            dict(K=4, HAS_BIAS=has_state, HAS_STATE=has_state, BLOCK=conv1d.BLOCK_C), (), Launch)
    build_sm90(conv1d._keep_kernel, dict(
        x_ptr="*bf16", state_ptr="*bf16", row_seq_ptr="*i64", cu_ptr="*i64", start_ptr="*i64", slot_ptr="*i64",
        x_stride="i32", state_slot_stride="i32", state_row_stride="i32", C="i32"), dict(K=4, BLOCK=conv1d.BLOCK_C),
        (), Launch)
    build_sm90(rmsnorm._gated_rmsnorm_kernel, dict(
        x_ptr="*fp32", z_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", x_stride="i32", z_stride="i32",
        out_stride="i32", group_size="i32", eps="fp32"), dict(BLOCK=512), (), Launch)
