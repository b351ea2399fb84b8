"""Gate C7 on a sliced Nemotron-H hybrid in BF16 on the CPU, over several draws (the gate's seed): how far the
gradients of each parameter group fall from the float64 reference, and why some draws fail.

The GPU check of the sliced hybrid (tests/consistency/test_hybrid_check_gpu.py) failed C7 on one group, mamba.ssm
(A_log, D, dt_bias of the one Mamba layer), over bf16's bound; this asks what the CPU shows on the same model.
Prints one line per seed: passed, the gate's line, the forward log-prob error, the mamba.ssm group.

    PYTHONPATH=. python lab/c7_bf16_draws.py [SEEDS] [DEVICE] > lab/results/c7-bf16-draws.log
DEVICE cuda asks the same of the CUDA kernels (the GPU's failure: the draw, or the CUDA path?).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from onepath.consistency.gates import run_gates
from onepath.numerics.spec import OPS, OpSpec
from onepath.ops import ExecutionSpec
from tests.consistency.test_hybrid_check_gpu import CHUNK, make_sliced


def main(seeds: int, device: str = "cpu") -> None:
    sliced = make_sliced(Path(tempfile.mkdtemp()))  # tests/consistency/test_hybrid_check_gpu.py's model
    for dtype in ("float32", "bfloat16"):
        ops = {name: OpSpec(dtype=dtype) for name in OPS}
        ops.update(logprobs=OpSpec(dtype="float32"), sampling=OpSpec(dtype="float32"), topk=OpSpec(dtype="float32"))
        spec = ExecutionSpec(mode="consistent", device=device, ops=ops).with_op("ssd", chunk=CHUNK)
        for seed in range(seeds):
            (r,) = run_gates(str(sliced), ("C7",), device=device, spec=spec, seed=seed)
            ssd = r.evidence["groups"]["mamba.ssm"]
            stock = f", stock {ssd['stock_rel_err']:.3g}" if "stock_rel_err" in ssd else ""
            print(f"{device} {dtype} seed {seed}: {'PASS' if r.passed else 'FAIL'} {r.detail}; forward "
                  f"{r.evidence['forward_logprob_rel_err']:.3g}; mamba.ssm {ssd['rel_err']:.3g}{stock} (worst "
                  f"{ssd['worst_param']} {ssd['worst_rel_err']:.3g})", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8, sys.argv[2] if len(sys.argv) > 2 else "cpu")
