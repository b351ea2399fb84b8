"""Triton kernels for CUDA (Hopper): the consistent backend on the GPU."""
import os


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1): no inline asm, no Gluon."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
