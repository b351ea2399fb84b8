"""The device a command asks for, checked before any work: one sentence instead of torch's assertion."""
from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


def require_device(device: str, option: str = "--device") -> None:
    """Raise ValueError naming `option` when this torch cannot run on `device`."""
    if device not in DEVICES:
        raise ValueError(f"{option} {device!r} is not a device: use one of {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        why = ("is a CPU-only build" if torch.version.cuda is None
               else "sees no CUDA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)")
        raise ValueError(f"{option} cuda: this torch {torch.__version__} {why}: run with {option} cpu, or on a "
                         "machine with a GPU and a CUDA build of torch")
