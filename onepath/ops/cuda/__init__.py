"""Triton kernels for CUDA (Hopper): the consistent backend on the GPU."""
