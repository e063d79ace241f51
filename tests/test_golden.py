"""Every policy keeps producing the greedy tokens and kept positions recorded before the core refactor.

See :mod:`tests.golden` for the runs; the fixture was recorded with the pre-refactor code.
"""

from __future__ import annotations

import json

import pytest
import torch

import beaconkv
from beaconkv.policies import make_policy

from .golden import CASES, FIXTURE, NEW_TOKENS, POLICIES, PROMPTS, digest


@pytest.fixture(scope="module")
def embedded():
    path = beaconkv.embedded_model_path()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the fixture was recorded single-threaded
    yield beaconkv.load_model(path, dtype=torch.float32), beaconkv.load_tokenizer(path)
    torch.set_num_threads(before)


GOLDEN = json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", POLICIES)
def test_tokens_and_kept_positions_equal_the_recorded_run(embedded, case, name):
    model, tok = embedded
    want = GOLDEN[f"{case}/{name}"]
    kwargs = {} if name == "full" else {"budget": 32, "n_recent": 4, **CASES[case]}
    policy = make_policy(name, telemetry=True, **kwargs)
    out = beaconkv.generate(model, tok, PROMPTS, chat=True, max_new_tokens=NEW_TOKENS, eos_token_ids=[], policy=policy)
    records = [(r.step, r.layer, list(r.rows), r.kept_positions.tolist()) for r in policy.stats.telemetry]
    assert out.token_ids == want["tokens"]
    assert out.stats.evictions == want["evictions"]
    assert [list(r) for r in records if r[1] == 0] == want["layer0_kept"]
    assert digest(records) == want["kept_digest"]
