"""Objects from a user's own Python file, named `path/to/file.py:NAME` (a reward, a toolbox)."""
from __future__ import annotations

import importlib.util
from pathlib import Path


def load_object(spec: str, what: str, define: str, kind: str = "function"):
    """NAME from the file of `spec` = path/to/file.py:NAME. `what` names it in errors ("reward"), `define`
    says how to write it ("def NAME(prompt, completion, **row) -> float", NAME filled in)."""
    path, _, name = spec.rpartition(":")
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{what} file {file} not found (from {spec!r}): check the path")
    module_spec = importlib.util.spec_from_file_location(f"onepath_{what}_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: its own error, in one line
        raise ValueError(f"{what} file {file} failed to import: {type(e).__name__}: {e}: fix the file") from None
    value = getattr(module, name, None)
    if value is None:
        raise ValueError(f"{what} file {file} has no {kind} {name!r}: define {define.replace('NAME', name)} there, "
                         "or fix the name after ':'")
    return value
