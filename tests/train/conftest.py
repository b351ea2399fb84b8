import pytest

DIGITS = "def digits(prompt, completion, **row):\n    return sum(c.isdigit() for c in completion) / 8\n"


@pytest.fixture(scope="module")
def reward(tmp_path_factory) -> str:
    """A reward with signal from the first step, so every update moves the weights."""
    path = tmp_path_factory.mktemp("reward") / "digits.py"
    path.write_text(DIGITS)
    return f"{path}:digits"
