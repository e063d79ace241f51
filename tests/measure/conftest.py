"""Measure tests run single-threaded: tiny matmuls on a shared, busy 2-core machine are far faster
without OpenMP threads competing (and the fidelity CLI's ``--threads`` must not leak into other tests)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
