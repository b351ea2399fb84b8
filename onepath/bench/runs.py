"""`onepath train` as a benchmark runs it: a fresh process per run, so no run inherits another's
compiled kernels, allocator state or garbage (and bench stays below the command line)."""
from __future__ import annotations

import subprocess
import sys


def train(argv: list[str]) -> int:
    """Run `onepath train ARGV` in a new Python process; its exit status."""
    return subprocess.run([sys.executable, "-m", "onepath", "train", *argv]).returncode
