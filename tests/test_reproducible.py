"""The suite's own reproducibility: every run of ``make test`` draws the same Hypothesis examples."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


@pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci",
                    reason="a random Hypothesis profile was chosen on purpose (HYPOTHESIS_PROFILE)")
def test_property_tests_draw_the_same_examples_on_every_machine(request):
    if request.config.getoption("hypothesis_profile", None) not in (None, "ci"):
        pytest.skip("a random Hypothesis profile was chosen on purpose (--hypothesis-profile)")
    active = settings.default
    # derandomized (examples from a hash of each test) and no example database: a clean clone on any
    # machine replays exactly the examples CI drew, and no local .hypothesis folder changes them
    assert active.derandomize and active.database is None
