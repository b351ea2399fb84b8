"""`onepath train` as a benchmark runs it: a fresh process per run, so no run inherits another's
compiled kernels, allocator state or garbage (and bench stays below the command line)."""
from __future__ import annotations

import subprocess
import sys

TIMED_OUT = 124  # timeout(1)'s status


def train(argv: list[str], timeout: float | None = None) -> int:
    """Run `onepath train ARGV` in a new Python process; its exit status, TIMED_OUT when it ran past
    `timeout` seconds and was killed (what it logged until then stays)."""
    try:
        return subprocess.run([sys.executable, "-m", "onepath", "train", *argv], timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return TIMED_OUT
