"""Shared setup of the nanguard pytest suite."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state and 2 threads."""
    torch.manual_seed(0)
    torch.set_num_threads(2)
