"""A Triton kernel built for the H200 (sm_90) without a GPU, by the Triton wheel's own ptxas: what a launch on
the H200 would compile. Tests check a build's instructions, layouts and shared memory on the CPU with it, and
lab/attention_sass.py counts its SASS."""
from __future__ import annotations

# Hopper's opt-in shared memory per block (227 KiB); a config over it fails at launch on the H200.
SHARED_BYTES = 232448


def build(kernel, sig: dict, consts: dict, aligned, num_warps: int, num_stages: int, enable_fp_fusion: bool = True):
    """The CompiledKernel of `kernel` for sm_90 (every stage's text in .asm: ttgir, ptx, cubin). sig: argument ->
    Triton type; consts: constexpr argument -> value; aligned: arguments divisible by 16 (what a launch
    specialises on); num_warps, num_stages, enable_fp_fusion: the launch's options."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {**sig, **{n: "constexpr" for n in consts}}
    src = ASTSource(kernel, {n: sig[n] for n in names}, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=enable_fp_fusion))
