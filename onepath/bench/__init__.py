"""Benchmarks behind `onepath bench`: each times a workload and writes a JSON result with its command."""
