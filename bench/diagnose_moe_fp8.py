"""Where does the MoE model with block-FP8 experts lose trainer == engine on the GPU? A diagnosis, not a test.

    python bench/diagnose_moe_fp8.py > bench/results/moe-fp8-diagnosis.log

The model of tests/gpu/test_moe_gpu.py with the fp8 preset. Prints: (1) whether the FP8 linear's rows
keep their bits as M grows, at the expert shapes; (2) layer 0's experts in the masked and contiguous
layouts and each token alone; (3) the diff metrics of tests/gpu/test_engine_gpu.py's trainer_diffs (two
RL steps with an update between); (4) onepath bisect trainer vs engine (the recorder cannot align the
experts' calls yet: it needs one output row per token).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, installed or not


def main():
    if not torch.cuda.is_available():
        print("diagnose_moe_fp8: no CUDA device here; nothing run (run it on the GPU machine)")
        return
    import pytest

    from onepath.consistency.bisect import PRESETS, Side, bisect, parse_layout, random_others
    from onepath.numerics.spec import ExecutionSpec
    from onepath.ops.quant_linear import quant_linear
    from tests.gpu import test_engine_gpu as dense
    from tests.gpu.test_moe_gpu import SHAPE, moe_model

    spec = ExecutionSpec.default("consistent", "cuda", quant="fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((512, 512), (512, 256), (1000, 512), (1536, 512)):
        w = (torch.randn(n, k, generator=g, device="cuda") * 0.05).bfloat16()
        x = torch.randn(300, k, generator=g, device="cuda").bfloat16()
        for out_dtype in (torch.bfloat16, torch.float32):
            full = quant_linear(spec, x, w, None, out_dtype)
            bad = [m for m in (1, 2, 7, 16, 33, 64, 65, 128, 129, 200)
                   if not torch.equal(quant_linear(spec, x[:m], w, None, out_dtype), full[:m])]
            print(f"fp8 linear N {n} K {k} out {out_dtype}: row-prefix M that differ from M=300: {bad}", flush=True)
    block = moe_model("consistent", quant="fp8").model.layers[0].mlp
    x = torch.randn(60, SHAPE["hidden_size"], generator=g, device="cuda").bfloat16()
    with torch.no_grad():
        _, chosen = block.gate(x)
        con = block.experts(x, chosen, "contiguous")
        mas = block.experts(x, chosen, "masked")
        alone = torch.cat([block.experts(x[i:i + 1], chosen[i:i + 1], "masked") for i in range(60)])
    print("experts masked == contiguous:", torch.equal(con, mas), "alone == contiguous:", torch.equal(alone, con),
          flush=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dense, "model", lambda mode, seed=0: moe_model(mode, seed, quant="fp8"))
        for d in dense.trainer_diffs("consistent"):
            print("trainer diff:", {kk: vv for kk, vv in d.items() if "frac" in kk or "max" in kk}, flush=True)
    probe = torch.randint(3, 1000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    layouts = PRESETS["engine-trainer"][0], PRESETS["engine-trainer"][1].format(prompt=45)
    sides = []
    for i, text in enumerate(layouts):
        layout, batch, at = parse_layout(text)
        sides.append(Side(moe_model("consistent", seed=3, quant="fp8"), layout,
                          random_others(batch, len(probe), 1000, i), at, ("trainer", "engine")[i]))
    print(bisect(sides[0], sides[1], probe, None).format(), flush=True)


if __name__ == "__main__":
    main()
