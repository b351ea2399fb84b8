"""pyproject.toml states the supported versions: the ones this environment runs are inside them, the
dependencies that would break us on their next major release are bounded, and the Makefile's torch pin
(the one install route the README names) is a supported version."""
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REQUIREMENTS = {r.name: r for r in map(Requirement, PROJECT["dependencies"] + PROJECT["optional-dependencies"]["test"])}
BOUNDED = ("torch", "safetensors", "tokenizers", "pyyaml", "math-verify", "transformers", "triton", "numpy", "starlette",
           "uvicorn", "openai")


def test_installed_versions_are_within_the_stated_bounds():
    outside = [f"{name} {version(name)} not in {r.specifier}" for name, r in REQUIREMENTS.items()
               if (r.marker is None or r.marker.evaluate())
               and not r.specifier.contains(version(name), prereleases=True)]
    assert not outside, outside


def test_the_breaking_dependencies_have_an_upper_bound():
    unbounded = [name for name in BOUNDED
                 if not any(s.operator in ("<", "<=", "==") for s in REQUIREMENTS[name].specifier)]
    assert not unbounded, f"{unbounded}: a plain pip install could take an untested major release"


def test_the_makefile_installs_a_supported_torch():
    pin = re.search(r"pip install -q torch==(\S+)", (ROOT / "Makefile").read_text())
    assert pin, "the Makefile no longer pins torch"
    assert REQUIREMENTS["torch"].specifier.contains(pin.group(1)), (pin.group(1), str(REQUIREMENTS["torch"].specifier))
