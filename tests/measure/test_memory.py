"""``beaconkv memory`` against figures computed by hand here (the paper's Table-4 setting), the parameter
count against models built on the meta device, and the plan's exact terms against what a real session allocates."""

from __future__ import annotations

import gc
import json
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beaconkv.cli import main
from beaconkv.measure.memory import (
    MEMORY_UNITS,
    MemoryPlanError,
    build_policy,
    index_bytes,
    kv_token_bytes,
    largest_batch,
    memory_plan,
    model_config,
    parameter_count,
    parse_memory,
    policy_state_bytes,
    weight_bytes,
    workspace_terms,
)
from beaconkv.models.config import ModelConfig
from beaconkv.models.decoder import build_model
from beaconkv.models.random_weights import RANDOM_SHAPES, qwen3_4b_config, qwen3_tiny_config, random_model
from beaconkv.policies import PolicyConfigError
from beaconkv.session import Session

from ..conftest import tiny_hf_config

# ------------------------------------------------------------------ Qwen3-4B by hand (paper Table 4)
# 36 layers, hidden 2560, 32 query / 8 KV heads of 128, MLP 9728, vocab 151936, tied embeddings, q/k norms.
EMBEDDING = 151936 * 2560                                    # 388,956,160
LAYER = (2560 * 32 * 128 * 2                                 # q and o projections
         + 2560 * 8 * 128 * 2                                # k and v projections
         + 128 * 2                                           # q_norm, k_norm
         + 3 * 2560 * 9728                                   # gate, up, down
         + 2560 * 2)                                         # input and post-attention norms
QWEN3_4B_PARAMETERS = EMBEDDING + 36 * LAYER + 2560           # + the final norm; the LM head is the embedding
KV_PER_TOKEN = 2 * 36 * 8 * 128 * 2                           # keys and values, bf16
KV_PER_TOKEN_INT8 = 2 * 36 * 8 * (128 * 1 + 2)                # int8 elements + one float16 scale per token and head
PROMPT, TOKENS, BATCH, BUDGET = 64, 32768, 14, 2048
FULL_SLOTS = PROMPT + TOKENS                                  # 32,832
BEACON_SLOTS = PROMPT + BUDGET                                # the whole prompt protected + the budget: 2,112
USABLE = 85_899_345_920 * 9 // 10                             # 80 GiB at 0.9


def test_hand_figures_are_what_they_say():
    assert LAYER == 100_930_816 and QWEN3_4B_PARAMETERS == 4_022_468_096  # ≈ 4.02 B
    assert KV_PER_TOKEN == 147_456 and KV_PER_TOKEN_INT8 == 74_880
    assert FULL_SLOTS * KV_PER_TOKEN * BATCH == 67_777_855_488        # 63.12 GiB
    assert BEACON_SLOTS * KV_PER_TOKEN * BATCH == 4_359_979_008       # 4.06 GiB


def test_qwen3_4b_weights_and_kv_per_token():
    config = qwen3_4b_config()
    assert parameter_count(config) == QWEN3_4B_PARAMETERS
    assert weight_bytes(config, torch.bfloat16) == 2 * QWEN3_4B_PARAMETERS
    assert weight_bytes(config, torch.float32) == 4 * QWEN3_4B_PARAMETERS
    assert kv_token_bytes(config, torch.bfloat16) == KV_PER_TOKEN
    assert kv_token_bytes(config, torch.float32) == 2 * KV_PER_TOKEN
    assert kv_token_bytes(config, torch.bfloat16, "int8") == KV_PER_TOKEN_INT8
    assert kv_token_bytes(config, torch.float32, "int8") == KV_PER_TOKEN_INT8  # int8 whatever the compute dtype


@pytest.fixture(scope="module")
def table4():
    return memory_plan(qwen3_4b_config(), ["full", "beacon"], batch=BATCH, tokens=TOKENS, prompt=PROMPT,
                       budget=BUDGET, device_memory="80GiB")


def test_table4_slots_kv_and_index(table4):
    full, beacon = table4
    assert (full.policy, full.budget, full.slots) == ("full", None, FULL_SLOTS)
    assert (beacon.policy, beacon.budget, beacon.slots) == ("beacon", BUDGET, BEACON_SLOTS)
    assert full.kv_bytes == FULL_SLOTS * KV_PER_TOKEN * BATCH == 67_777_855_488
    assert beacon.kv_bytes == BEACON_SLOTS * KV_PER_TOKEN * BATCH == 4_359_979_008
    # one int64 position per slot and KV head, an int64 length and a bool flag per row, in 36 layers
    assert full.index_bytes == 36 * (BATCH * 8 * FULL_SLOTS * 8 + BATCH * 9) == 1_059_033_528
    for row in table4:
        assert row.weights_bytes == 2 * QWEN3_4B_PARAMETERS
        assert row.peak_bytes == (row.weights_bytes + row.kv_bytes + row.index_bytes + row.state_bytes
                                  + row.workspace_bytes)
        assert row.usable_bytes == USABLE


def test_table4_state_by_hand(table4):
    full, beacon = table4
    # FullKV keeps three int64 per row (newest position, prefix length, row index)
    assert full.state_bytes == 3 * BATCH * 8
    # BeaconKV holds, per layer, 16 beacons and 16 observed queries per query head (bf16 vectors, int64
    # positions, bool flags) and a ring of the last 32 pre-RoPE queries; its state is far below the cache
    vectors = 36 * BATCH * 32 * (16 + 16 + 32) * 128 * 2
    assert vectors < beacon.state_bytes < vectors * 1.25
    assert beacon.state_bytes < beacon.kv_bytes / 10


def test_table4_largest_batch_at_80gib(table4):
    full, beacon = table4
    per_sequence = FULL_SLOTS * KV_PER_TOKEN + 36 * (8 * FULL_SLOTS * 8 + 9)
    # 14 sequences leave over 0.4 GB for the policy's state and the transients; a 15th does not fit at all
    assert USABLE - (2 * QWEN3_4B_PARAMETERS + 14 * per_sequence) > 400_000_000
    assert 2 * QWEN3_4B_PARAMETERS + 15 * per_sequence > USABLE
    assert full.max_batch == 14  # the paper's FullKV batch on an 80 GB A100
    assert full.peak_bytes <= USABLE
    # BeaconKV: below what the cache and index alone allow, and the largest that fits
    beacon_per_sequence = BEACON_SLOTS * KV_PER_TOKEN + 36 * (8 * BEACON_SLOTS * 8 + 9)
    assert 150 < beacon.max_batch <= (USABLE - 2 * QWEN3_4B_PARAMETERS) // beacon_per_sequence == 218
    policy = build_policy("beacon", BUDGET)
    (fits,) = memory_plan(qwen3_4b_config(), [policy], batch=beacon.max_batch, tokens=TOKENS)
    (over,) = memory_plan(qwen3_4b_config(), [policy], batch=beacon.max_batch + 1, tokens=TOKENS)
    assert fits.peak_bytes <= USABLE < over.peak_bytes
    assert largest_batch(qwen3_4b_config(), policy, TOKENS, USABLE) == beacon.max_batch


def test_table4_tokens_that_fit(table4):
    full, beacon = table4
    # FullKV at batch 14: the cache grows with every token; BeaconKV's does not, so the context bounds it
    assert TOKENS <= full.max_tokens < TOKENS + 400 and not full.context_bound
    assert beacon.max_tokens == 40960 - PROMPT and beacon.context_bound


def test_table4_memory_ratio_is_the_papers(table4):
    full, beacon = table4
    assert full.peak_bytes / 1e9 == pytest.approx(77.0, abs=0.5)       # the paper measured 77.0 GB
    assert beacon.peak_bytes / 1e9 == pytest.approx(13.3, abs=0.5)     # and 13.3 GB
    assert 5.5 < full.peak_bytes / beacon.peak_bytes < 6.1             # "5.8x less memory"


def test_int8_storage(table4):
    full, beacon = memory_plan(qwen3_4b_config(), ["full", "beacon"], batch=BATCH, tokens=TOKENS, budget=BUDGET,
                               kv_storage="int8", device_memory="80GiB")
    assert full.kv_bytes == FULL_SLOTS * KV_PER_TOKEN_INT8 * BATCH == 34_418_442_240
    assert beacon.kv_bytes == BEACON_SLOTS * KV_PER_TOKEN_INT8 * BATCH
    assert full.index_bytes == table4[0].index_bytes  # positions do not depend on the storage
    # int8 attention dequantises one layer's keys (then values) to float32: B·k·C·d·4
    assert full.workspace["decode"]["int8 dequantised"] == BATCH * 8 * FULL_SLOTS * 128 * 4
    assert full.max_batch > table4[0].max_batch


def test_prefill_chunk_uses_the_policys_rule():
    policy = build_policy("beacon", 256, n_prefix=4)
    (row,) = memory_plan(qwen3_4b_config(), [policy], batch=2, tokens=1000, prompt=4000, prefill_chunk=512)
    assert row.slots == policy.capacity([4000], 1000, prefill_chunk=512) <= 4 + 256 + 512
    assert row.workspace["prefill"]["chunk mask"] == 2 * 8 * 512 * row.slots
    (whole,) = memory_plan(qwen3_4b_config(), [policy], batch=2, tokens=1000, prompt=4000)
    assert whole.slots == 4000 and whole.kv_bytes > row.kv_bytes  # without chunks the whole prompt is held


# ------------------------------------------------------------------------------------- the units
@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("81920MiB", 80 * 2**30), ("80gib", 80 * 2**30),
    ("80 GB", 80_000_000_000), ("79.5GiB", 85_362_475_008), ("0.5KB", 500), ("1.5B", 1), ("2TiB", 2 * 2**40),
    (4096, 4096),
])
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**6), st.sampled_from(sorted(MEMORY_UNITS)), st.booleans(), st.booleans())
def test_parse_memory_any_amount_and_spelling(number, unit, lower, space):
    text = f"{number}{' ' if space else ''}{unit.lower() if lower else unit}"
    assert parse_memory(text) == number * MEMORY_UNITS[unit]


def test_nothing_fits_a_device_smaller_than_the_weights():
    (row,) = memory_plan(qwen3_4b_config(), ["full"], batch=1, tokens=8, device_memory="8GB")
    assert row.weights_bytes > 8 * 10**9 * 0.9 and (row.max_batch, row.max_tokens) == (0, 0)


@pytest.mark.parametrize("text,fragment", [
    ("80", "not a number with a unit"), ("80XB", "unknown unit 'XB'"), ("0GB", "at least 1 byte"),
    ("-1GB", "not a number with a unit"), ("", "not a number with a unit"), ("eighty GB", "not a number"),
])
def test_parse_memory_refuses(text, fragment):
    with pytest.raises(MemoryPlanError, match=fragment):
        parse_memory(text)


def test_bad_settings_name_the_value():
    config = qwen3_tiny_config()
    with pytest.raises(MemoryPlanError, match="batch=0"):
        memory_plan(config, ["full"], batch=0, tokens=8)
    with pytest.raises(MemoryPlanError, match="memory_fraction=1.5"):
        memory_plan(config, ["full"], batch=1, tokens=8, device_memory="1GiB", memory_fraction=1.5)
    with pytest.raises(MemoryPlanError, match="kv_storage='fp8'"):
        memory_plan(config, ["full"], batch=1, tokens=8, kv_storage="fp8")
    with pytest.raises(PolicyConfigError, match="needs a budget"):
        memory_plan(config, ["beacon"], batch=1, tokens=8)


# ------------------------------------------------------------------------- parameters vs the model
def _meta_parameters(config: ModelConfig) -> int:
    with torch.device("meta"):
        model = build_model(config)
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


def _from_hf(kind: str, tmp_path, **changes) -> ModelConfig:
    hf = tiny_hf_config(kind)
    for key, value in changes.items():
        setattr(hf, key, value)
    hf.to_json_file(tmp_path / "config.json", use_diff=False)
    config, label = model_config(str(tmp_path))  # a checkpoint directory: its config.json alone
    assert label == str(tmp_path)
    return config


@pytest.mark.parametrize("kind,changes", [
    ("llama", {}), ("llama", {"attention_bias": True}), ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}), ("qwen3", {"tie_word_embeddings": False}),
])
def test_parameter_count_equals_the_meta_model(kind, changes, tmp_path):
    config = _from_hf(kind, tmp_path, **changes)
    assert parameter_count(config) == _meta_parameters(config)


@pytest.mark.parametrize("shape", sorted(RANDOM_SHAPES))
def test_parameter_count_of_the_random_shapes(shape):
    config = RANDOM_SHAPES[shape]()
    assert parameter_count(config) == _meta_parameters(config)
    assert model_config(shape) == (config, f"{shape} (shape)")


def test_a_hub_id_downloads_its_config_json_alone(tmp_path, monkeypatch):
    import huggingface_hub

    _from_hf("qwen3", tmp_path)
    asked = []

    def download(repo_id: str, filename: str) -> str:
        asked.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    config, label = model_config("someone/tiny-qwen3")
    assert asked == [("someone/tiny-qwen3", "config.json")] and label == "someone/tiny-qwen3"
    assert parameter_count(config) == _meta_parameters(config)


def test_model_config_refuses_what_is_not_there(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        model_config(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_config(str(tmp_path))  # a directory without config.json


# --------------------------------------------------------------- the exact terms vs a real session
def _reachable_storages(root: object) -> dict[int, int]:
    """Every tensor storage reachable from ``root`` through Python references (an independent count)."""
    seen, out, stack = set(), {}, [root]
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            out[s._cdata] = s.nbytes()
        else:
            stack.extend(gc.get_referents(obj))
    return out


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(qwen3_tiny_config(), torch.float32, "cpu")


@pytest.mark.parametrize("name", ["full", "beacon", "snapkv", "h2o", "tova", "knorm", "triattention"])
@pytest.mark.parametrize("storage", ["dense", "int8"])
def test_exact_terms_equal_a_real_sessions_allocation(name, storage, tiny_model):
    config = tiny_model.config
    policy = build_policy(name, None if name == "full" else 64)
    (row,) = memory_plan(config, [policy], batch=3, tokens=200, prompt=20, dtype=torch.float32, kv_storage=storage)
    session = Session(tiny_model, policy, batch=3, capacity=policy.capacity([20], 200), max_tokens=220,
                      kv_storage=storage)
    assert row.slots == session.cache.capacity
    assert row.kv_bytes == session.cache.nbytes()
    assert row.index_bytes == sum(b.nbytes for layer in session.cache.layers
                                  for b in (layer.pos, layer.length, layer.active))
    owned = {t.untyped_storage()._cdata for t in [*session.cache.buffers(), *tiny_model.parameters(),
                                                    *tiny_model.buffers()]}
    state = sum(n for key, n in _reachable_storages(session.state).items() if key not in owned)
    assert row.state_bytes == state > 0


def test_state_and_workspace_grow_with_the_batch():
    config, policy = qwen3_tiny_config(), build_policy("beacon", 64)
    sizes = [policy_state_bytes(config, policy, b, 84, 220, torch.float32) for b in (1, 2, 3)]
    assert sizes[0] < sizes[1] < sizes[2] and sizes[2] - sizes[1] == sizes[1] - sizes[0]
    terms = workspace_terms(config, policy, 4, 84, 20, 220, torch.float32)
    # the eviction's score tensors: two float32 (B, kv, group, n_queries, C) alive at once, n_queries = 16
    # beacons + 8 recent queries (n_recent auto at budget 64)
    assert (policy.n_beacon, policy.n_recent) == (16, 8)
    assert terms["eviction"]["scores"] == 2 * 4 * 2 * 2 * 24 * 84 * 4
    assert terms["decode"]["logits"] == 4 * 49152 * (4 + 4)
    assert "eviction" not in {m for m, t in workspace_terms(config, build_policy("full"), 4, 84, 20, 220).items()
                              if t}
    assert index_bytes(config, 4, 84) == 2 * (4 * 2 * 84 * 8 + 4 * 9)


# ------------------------------------------------------------------------------------- the command
def test_cli_prints_the_table(capsys):
    rc = main(["memory", "--model", "qwen3-4b", "--batch", "14", "--tokens", "32768", "--budget", "2048",
               "--device-memory", "80GiB"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "4.022 B parameters" in out and "147,456 KV bytes per token (dense)" in out
    assert ("| policy | slots/seq | KV GiB | index+state GiB | workspace GiB | peak GiB | largest batch in 72.00 GiB "
            "| tokens at batch 14 |") in out
    assert "| full | 32832 | 63.12 | 0.99 |" in out and "| 71.72 | 14 |" in out
    assert "| beacon (2048) | 2112 | 4.06 |" in out and "| 12.21 |" in out


def test_cli_json(capsys):
    rc = main(["memory", "--model", "qwen3-4b", "--batch", "14", "--budget", "2048", "--kv-storage", "int8",
               "--policies", "full,beacon,snapkv", "--device-memory", "80GB", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (data["parameters"], data["kv_token_bytes"], data["device_memory_bytes"]) == (
        QWEN3_4B_PARAMETERS, KV_PER_TOKEN_INT8, 80_000_000_000)
    assert [r["policy"] for r in data["rows"]] == ["full", "beacon", "snapkv"]
    assert [r["kv_bytes"] for r in data["rows"]] == [FULL_SLOTS * KV_PER_TOKEN_INT8 * 14,
                                                     BEACON_SLOTS * KV_PER_TOKEN_INT8 * 14,
                                                     BEACON_SLOTS * KV_PER_TOKEN_INT8 * 14]
    assert data["rows"][0]["usable_bytes"] == 72_000_000_000


def test_cli_errors_are_one_line(capsys):
    assert main(["memory", "--model", "qwen3-tiny", "--device-memory", "80"]) == 2
    assert "not a number with a unit" in capsys.readouterr().err
    assert main(["memory", "--model", "qwen3-tiny", "--policies", "full", "--budget", "64"]) == 2
    assert "--budget 64 would be ignored" in capsys.readouterr().err
    assert main(["memory", "--model", "qwen3-tiny", "--policy-arg", "n_bogus=1"]) == 2
    assert "n_bogus" in capsys.readouterr().err
