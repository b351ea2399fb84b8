"""Runs a test file's Triton kernel checks in a subprocess under TRITON_INTERPRET=1 (it must be set
before triton is imported) and returns the JSON they print on the last line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def interpreted_results(script: str, what: str) -> dict:
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, script], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreted {what} checks crashed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
