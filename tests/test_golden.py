"""Every policy keeps producing the greedy tokens and kept positions recorded before the core refactor.

See :mod:`tests.golden` for the runs; the fixture was recorded with the pre-refactor code.

One behaviour changed on purpose in the same change: FPS now breaks ties between exact duplicate
points on the lowest index (SPEC §3) with a tolerance of a rounding step (``TIE_RTOL``), where the old
code took the exact minimum of GEMM-rounded scores (a later duplicate could win). BeaconKV therefore
runs here with ``FPS(tie_rtol=0)`` — the old rule — so that the refactor itself is checked
bit for bit; :func:`test_the_tie_rule_changes_only_rows_with_duplicate_candidates` checks the
default rule's difference.

KNorm's entries were recorded again when its ranking learned the same lesson: two copies of one key
(the same token at layer 0) get norms a rounding step apart once rotated, in a CPU-dependent order, so
the first recording failed on other CPUs. Norms that close now tie (``KNorm.tie_rtol``) and the newer
copy stays; the tokens did not change, and at layer 0 (stored in full) every kept set that moved
swapped one copy of a token for another copy of it (4 moves in the two runs).
"""

from __future__ import annotations

import json

import pytest
import torch

import beaconkv
from beaconkv.policies import FPS, make_policy

from .golden import CASES, FIXTURE, NEW_TOKENS, POLICIES, PROMPTS, digest


@pytest.fixture(scope="module")
def embedded():
    path = beaconkv.embedded_model_path()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the fixture was recorded single-threaded
    yield beaconkv.load_model(path, dtype=torch.float32), beaconkv.load_tokenizer(path)
    torch.set_num_threads(before)


GOLDEN = json.loads(FIXTURE.read_text())


#: FullKV takes no policy settings, so its run is the same in every case: run once (the fixture's two
#: records of it are checked equal below).
RUNS = [(case, name) for case in CASES for name in POLICIES if name != "full" or case == next(iter(CASES))]
#: The ragged case (an int prefix) of every policy runs in ``make test-long`` (and CI); ``make test``
#: runs the first case of every policy.
RUN_PARAMS = [pytest.param(case, name, marks=pytest.mark.long) if case != next(iter(CASES)) else (case, name)
              for case, name in RUNS]


def test_fullkv_is_recorded_alike_in_every_case():
    assert len({json.dumps(GOLDEN[f"{case}/full"], sort_keys=True) for case in CASES}) == 1


@pytest.mark.parametrize(("case", "name"), RUN_PARAMS)
def test_tokens_and_kept_positions_equal_the_recorded_run(embedded, case, name):
    model, tok = embedded
    want = GOLDEN[f"{case}/{name}"]
    kwargs = {} if name == "full" else {"budget": 32, "n_recent": 4, **CASES[case]}
    if name in ("beacon", "initial_recent"):
        kwargs["sampler"] = FPS(tie_rtol=0.0)  # the pre-refactor tie rule (see the module docstring)
    policy = make_policy(name, telemetry=True, **kwargs)
    out = beaconkv.generate(model, tok, PROMPTS, chat=True, max_new_tokens=NEW_TOKENS, eos_token_ids=[], policy=policy)
    records = [(r.step, r.layer, list(r.rows), r.kept_positions.tolist()) for r in out.telemetry]
    assert out.token_ids == want["tokens"]
    assert out.stats.evictions == want["evictions"]
    assert [list(r) for r in records if r[1] == 0] == want["layer0_kept"]
    assert digest(records) == want["kept_digest"]


@pytest.mark.long
def test_the_tie_rule_changes_only_rows_with_duplicate_candidates(embedded):
    """With the default FPS tie rule every run keeps its tokens; BeaconKV's kept sets move only in the
    ragged run, where the roll's candidates (beacons ∪ recent) hold exact duplicates of the last prompt
    queries (3 of its 930 layer-evictions, found when the rule was introduced)."""
    model, tok = embedded
    for case, extra in CASES.items():
        policy = make_policy("beacon", telemetry=True, budget=32, n_recent=4, **extra)
        out = beaconkv.generate(model, tok, PROMPTS, chat=True, max_new_tokens=NEW_TOKENS, eos_token_ids=[],
                                policy=policy)
        want = GOLDEN[f"{case}/beacon"]
        assert out.token_ids == want["tokens"] and out.stats.evictions == want["evictions"]
        if case == "prompt_prefix":
            records = [(r.step, r.layer, list(r.rows), r.kept_positions.tolist()) for r in out.telemetry]
            assert digest(records) == want["kept_digest"]
        else:
            layer0 = [[r.step, r.layer, list(r.rows), r.kept_positions.tolist()] for r in out.telemetry if r.layer == 0]
            assert layer0 == want["layer0_kept"]
