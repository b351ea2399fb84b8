"""bench/engine_host.py on a small batch: every phase is timed on all-decode steps of the whole batch."""
import argparse

from onepath.bench import engine_host as bench


def test_engine_host_smoke():
    args = argparse.Namespace(batch=8, prompt=20, max_model_len=64, warmup=3, steps=5, out=None)
    ms = bench.run(args)["host_ms_per_step"]
    phases = ("schedule", "chunks", "stage", "sample_keys", "postprocess")
    assert all(ms[p] > 0 for p in phases) and abs(ms["total"] - sum(ms[p] for p in phases)) < 1e-9
