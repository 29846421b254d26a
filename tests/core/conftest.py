"""Shared settings of the CPU tests of cula_core."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny CPU problems: intra-op threads only add overhead, and stall badly on a loaded 2-core machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
