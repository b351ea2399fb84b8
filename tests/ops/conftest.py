import pytest
import torch

from onepath.numerics.spec import ExecutionSpec


@pytest.fixture
def consistent():
    return ExecutionSpec(mode="consistent")


@pytest.fixture
def baseline():
    return ExecutionSpec(mode="baseline")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
