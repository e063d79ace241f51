"""PolicyCache against its two references, on tiny random-weight llama / qwen2 / qwen3 (fp32, CPU).

* With room for the whole generation, HF + ``PolicyCache`` gives transformers' ``DynamicCache`` greedy tokens.
* With eviction, HF + ``PolicyCache`` and ``beaconkv.generate`` (the native decoder) with the same policy give
  the same greedy tokens and keep the same positions at every eviction, for BeaconKV and the baselines.
* A new token is rotated at its logical position, however many slots eviction freed.
"""

from __future__ import annotations

import pytest
import torch

import beaconkv
from beaconkv.hf import PolicyCache
from beaconkv.policies import H2O, RKV, RPC, BeaconKV, FullKV, Periodic, SnapKV, StreamingLLM

from ..conftest import save_tiny_model
from .helpers import NewestQuery, greedy, random_prompts, same_evictions

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, its sdpa twin's implementation name, beaconkv's load of the same weights).
    Built here, not taken from the session fixture: a PolicyCache switches a model's attention function."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(f"hf_{kind}")
        hf = save_tiny_model(kind, d)
        out[kind] = (hf, beaconkv.load_model(d))
    return out


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", KINDS)
def test_room_for_everything_gives_dynamic_cache_tokens(models, kind, impl):
    from transformers import DynamicCache

    hf, _ = models[kind]
    hf.set_attn_implementation(impl)
    for prompts in (random_prompts((17,), seed=1), random_prompts((6, 21, 13), seed=2)):
        want = greedy(hf, prompts, DynamicCache(config=hf.config), 40)
        for policy in (FullKV(), BeaconKV(budget=512)):
            assert greedy(hf, prompts, PolicyCache(hf, policy, max_new_tokens=40), 40) == want, (prompts, policy)
    hf.set_attn_implementation("sdpa")


POLICIES = {
    "beacon": lambda: BeaconKV(32, n_recent=4, n_beacon=4, telemetry=True),
    "snapkv": lambda: SnapKV(32, window=8, n_recent=4, telemetry=True),
    "h2o": lambda: H2O(32, n_recent=4, telemetry=True),
    "rkv": lambda: RKV(32, window=4, n_recent=4, telemetry=True),
    "rpc": lambda: RPC(None, window=8, n_recent=4, schedule=Periodic(period=32, compression=4), telemetry=True),
    "streaming": lambda: StreamingLLM(32, n_sink=2, n_recent=4, telemetry=True),
    "subclass": lambda: NewestQuery(32, n_recent=4, telemetry=True),  # a user's policy
}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("kind", KINDS)
def test_evicting_matches_the_native_decoder(models, kind, name):
    hf, ours = models[kind]
    prompts, steps = random_prompts((9, 20), seed=3), 80
    native = beaconkv.generate(ours, None, prompts, max_new_tokens=steps, eos_token_ids=[], policy=POLICIES[name]())
    cache = PolicyCache(hf, POLICIES[name](), max_new_tokens=steps)
    assert greedy(hf, prompts, cache, steps) == native.token_ids
    assert min(cache.state.stats.evictions) >= 2
    assert same_evictions(native.telemetry, cache.state.stats.telemetry) is None


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_token_is_rotated_at_its_logical_position(models, kind):
    """Teacher-forced, no position_ids: the model numbers each token from the cache's length. Layer 0's key of a
    token depends only on the token and its position, so the one kept in the store equals DynamicCache's at that
    position only if the position the model used is the logical one."""
    from transformers import DynamicCache

    hf, _ = models[kind]
    seq = torch.tensor(random_prompts((120,), seed=4))
    prompt = 20
    cache, dense = PolicyCache(hf, BeaconKV(32, n_recent=4, n_beacon=4)), DynamicCache(config=hf.config)
    with torch.no_grad():
        for c in (cache, dense):
            hf(input_ids=seq[:, :prompt], cache=c)
            for p in range(prompt, seq.shape[1]):
                hf(input_ids=seq[:, p:p + 1], cache=c)
    assert cache.get_seq_length() == dense.get_seq_length() == seq.shape[1]
    store = cache.store[0]
    held = int(store.length[0])
    assert held < seq.shape[1] - prompt and cache.state.stats.evictions[0] >= 3
    for h in range(store.n_kv_heads):
        positions = store.pos[0, h, :held]
        assert int(positions[-1]) == seq.shape[1] - 1
        torch.testing.assert_close(store.keys()[0, h, :held], dense.layers[0].keys[0, h, positions], atol=1e-6, rtol=0)


def test_left_padded_rows_store_their_logical_positions(models):
    hf, _ = models["llama"]
    prompts, steps = random_prompts((5, 23), seed=5), 60
    cache = PolicyCache(hf, BeaconKV(32, n_recent=4, n_beacon=4), max_new_tokens=steps)
    greedy(hf, prompts, cache, steps)
    assert cache.seen == max(map(len, prompts)) + steps - 1  # generate never feeds its last token back
    for layer in cache.store.layers:
        for b, p in enumerate(prompts):
            newest = layer.pos[b, :, int(layer.length[b]) - 1]
            assert newest.tolist() == [len(p) + steps - 2] * layer.n_kv_heads
            assert int(layer.length[b]) <= len(p) + 32


def test_a_batch_equals_its_rows_run_alone(models):
    hf, _ = models["qwen3"]
    prompts, steps = random_prompts((7, 25, 14), seed=6), 70
    batch = greedy(hf, prompts, PolicyCache(hf, BeaconKV(32, n_recent=4, n_beacon=4), max_new_tokens=steps), steps)
    singles = [greedy(hf, [p], PolicyCache(hf, BeaconKV(32, n_recent=4, n_beacon=4), max_new_tokens=steps), steps)[0]
               for p in prompts]
    assert batch == singles

