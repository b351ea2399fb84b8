"""ops/host.py: host values onto the device without a stream sync (the GPU half runs with the gpu marker)."""
import pytest
import torch

from onepath.ops.host import to_device


def test_values_and_dtype_on_the_cpu():
    out = to_device([3, -1, 2 ** 40], torch.int64, "cpu")
    assert out.dtype == torch.int64 and out.tolist() == [3, -1, 2 ** 40]
    table = torch.arange(6).view(2, 3)
    assert torch.equal(to_device(table, torch.int32, "cpu"), table.int())
    assert to_device([0.5, 1.0], torch.float32, torch.device("cpu")).tolist() == [0.5, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_copy_does_not_wait_for_the_device_and_the_stock_one_does():
    def busy_after(copy):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the copy
        done = torch.cuda.Event()
        copy()
        done.record()
        return not done.query()  # still queued: the host did not wait

    values = list(range(1000))
    assert busy_after(lambda: to_device(values, torch.int64, "cuda"))
    assert not busy_after(lambda: torch.tensor(values, device="cuda")), "control: the pageable copy waited"
    torch.cuda.synchronize()
    assert to_device(values, torch.int64, "cuda").tolist() == values


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refused_inside_a_graph_capture():
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            to_device([1, 2], torch.int64, "cuda")
