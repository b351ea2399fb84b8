"""Host and device: host values onto the device without waiting for the device, and whether a graph is recording.

`torch.tensor(values, device="cuda")` and a plain `.to("cuda")` copy from pageable memory and then
synchronise the stream: the host waits for every kernel queued before it, and the GPU then idles while
the host prepares the next launches (a decode step's sampler after its graph, an MoE layer's expert
GEMMs). A copy from pinned memory with non_blocking=True does neither; PyTorch's pinned-memory
allocator keeps the staging block until the copy has run. Not inside a CUDA graph capture: a captured
copy would read the same host block at every replay.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """values (a list, or a CPU tensor) as a `dtype` tensor on `device`, queued behind the device's work."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("to_device inside a CUDA graph capture: the graph would replay this step's host "
                           "values forever; stage the values into a static buffer instead")
    return host.pin_memory().to(device, non_blocking=True)


def capturing(x: torch.Tensor) -> bool:
    """True while x's device is recording a CUDA graph: host-side checks (a sync) must not run then."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()
