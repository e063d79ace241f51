"""One frozen DecodeSetup carries the runtime options from every entry point to the session."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from beaconkv import DecodeSetup, generate
from beaconkv.engine import Engine
from beaconkv.policies import SnapKV
from beaconkv.preparation import prepare_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_setup_is_frozen_and_checks_its_values():
    setup = DecodeSetup(kv_storage="int8", prefill_chunk=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.kv_storage = "dense"  # type: ignore[misc]
    for bad in ({"prefill_chunk": 0}, {"threads": -1}, {"prefill_chunk": True}, {"compile": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DecodeSetup(**bad)


def test_setup_or_keywords_but_not_both():
    assert DecodeSetup.of(None, kv_storage="int8") == DecodeSetup(kv_storage="int8")
    given = DecodeSetup(kernels="model")
    assert DecodeSetup.of(given, kv_storage="dense", kernels="auto") is given  # keywords at their defaults
    with pytest.raises(ValueError, match=r"not both.*kv_storage='int8'.*dataclasses.replace\(setup, kv_storage=...\)"):
        DecodeSetup.of(given, kv_storage="int8")


def test_the_setup_reaches_preparation_the_session_and_the_engine(llama):
    setup = DecodeSetup(kv_storage="int8", prefill_chunk=8, kernels="model")
    prepared = prepare_model(llama, 2, setup)
    assert prepared.setup.kv_storage == "int8" and prepared.setup.prefill_chunk == 8
    engine = Engine(llama, policy=SnapKV(16, n_recent=2, n_prefix=2), max_batch=2, prompt_capacity=40,
                    max_new_tokens=4, setup=setup)
    assert engine.session.setup is prepared.setup or engine.session.setup == prepared.setup
    assert engine.session.cache[0].storage.kind == "int8" and engine.prefill_chunk == 8
    assert engine.slot_capacity <= 2 + 16 + 8
    prompts = [list(range(3, 43)), list(range(5, 30))]
    by_setup = generate(llama, None, prompts, max_new_tokens=4, policy=SnapKV(16, n_recent=2, n_prefix=2),
                        setup=setup)
    by_keywords = generate(llama, None, prompts, max_new_tokens=4, policy=SnapKV(16, n_recent=2, n_prefix=2),
                           kv_storage="int8", prefill_chunk=8, kernels="model")
    assert by_setup.token_ids == by_keywords.token_ids and by_setup.stats.cache_capacity == engine.slot_capacity


def test_threads_are_set_where_the_setup_is_applied():
    before = torch.get_num_threads()
    try:
        DecodeSetup(threads=1).apply_threads()
        assert torch.get_num_threads() == 1
        DecodeSetup().apply_threads()  # None: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
