"""The SSD scan kernel's split dots (ops/cuda/ssd.py: an FP32 dot operand as BF16 hi + lo) against one rounding to
BF16 (split=False, as mamba-ssm's kernels round): y's and the state's largest error relative to their largest value
against a float64 token-by-token loop, on BF16 inputs under Triton's interpreter (two shapes, Q = 8), and each sm_90
build at Nemotron-3-Nano's mixer shape (no GPU needed) at 4 and 8 warps: its MMA instructions, registers, stack
and local-memory spill instructions (STL / LDL, from cuobjdump).

    TRITON_INTERPRET=1 python lab/ssd_split.py > lab/results/ssd-split.log
(the builds need the interpreter off: the script runs them in a subprocess without it)
"""
from __future__ import annotations

import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

Q = 8
LIMIT = (0.0, float("inf"))


def errors() -> None:
    from onepath.ops import ssd as SSD
    from onepath.ops.cuda import ssd as kssd
    from onepath.ops.spans import SeqSpans
    from tests.interpret import patch_gemm_interpreter
    from tests.ops.test_ssd import loop

    patch_gemm_interpreter()
    gen = torch.Generator().manual_seed(0)
    for (h, p, g, n), t in (((4, 6, 2, 8), 3 * Q + 5), ((2, 70, 1, 20), 2 * Q + 3)):
        params = (torch.log(1 + 7 * torch.rand(h, generator=gen)), torch.randn(h, generator=gen),
                  torch.randn(h, generator=gen) * 0.5 - 0.5)
        inputs = [torch.randn(t, h, p, generator=gen).bfloat16(), torch.randn(t, h, generator=gen),
                  torch.randn(t, g, n, generator=gen).bfloat16(), torch.randn(t, g, n, generator=gen).bfloat16()]
        want, want_state = loop(inputs, params)
        for split in (True, False):
            state = SSD.SSDState.empty(2, h, p, g, n, Q, torch.bfloat16, torch.float32)
            y = kssd.ssd(*inputs, *params, SeqSpans((0, t), (0,), (1,)), state, Q, LIMIT, torch.float32, split=split)
            after = SSD.state_after(state, 1, t, params[0])
            ey = float((y.double() - want).abs().max() / want.abs().max())
            es = float((after.double() - want_state).abs().max() / want_state.abs().max())
            print(f"H {h} P {p} G {g} N {n} T {t} {'split' if split else 'one rounding'}: y {ey:.2g}, state {es:.2g}")


def builds() -> None:
    import re

    from onepath.ops.cuda import ssd
    from tests.attention_sass import sass
    from tests.interpret import build_sm90

    ints = ("x_t", "x_h", "b_t", "b_g", "c_t", "c_g", "y_t", "y_h", "ssm_slot", "ssm_h", "ssm_p", "sx_slot", "sx_q",
            "sx_h", "sdt_slot", "sdt_q", "sb_slot", "sb_q", "sb_g", "H", "P", "N", "Q", "HEADS_PER_GROUP")
    block_p, block_n, block_q = ssd.blocks(64, 128, 128)
    sig = dict(x_ptr="*bf16", dt_ptr="*fp32", B_ptr="*bf16", C_ptr="*bf16", A_log_ptr="*fp32", D_ptr="*fp32",
               y_ptr="*fp32", cu_ptr="*i64", start_ptr="*i64", slot_ptr="*i64", ssm_ptr="*fp32", sx_ptr="*bf16",
               sdt_ptr="*fp32", sB_ptr="*bf16", **{n: "i32" for n in ints})
    for warps in (4, 8):
        class Launch:
            num_warps, num_stages, enable_fp_fusion = warps, 3, False
        for split in (True, False):
            built = build_sm90(ssd._ssd_scan_kernel, sig, dict(HAS_STATE=True, BLOCK_L=ssd.BLOCK_L, BLOCK_Q=block_q,
                                                               BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_S=ssd.BLOCK_S,
                                                               SPLIT=split), (), Launch)
            text, usage = sass(built.asm["cubin"])
            regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
            spills = len(re.findall(r"\b(STL|LDL)\b", text))
            print(f"sm_90 build, P 64 N 128 chunk 128, {warps} warps, {'split' if split else 'one rounding'}: "
                  f"{built.asm['ptx'].count('mma.sync')} mma.sync, {regs} registers, {stack} bytes of stack, "
                  f"{spills} STL/LDL, {built.metadata.shared} bytes of shared memory",
                  flush=True)


if __name__ == "__main__":
    if "--builds" in sys.argv:
        builds()
    else:
        errors()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        sys.stdout.flush()
        subprocess.run([sys.executable, __file__, "--builds"], env=env, check=True)
