"""PolicyCache on decoders beaconkv's own decoder does not run: Qwen3-MoE, gpt-oss (attention sinks, sliding
layers), Gemma 3 (sliding layers), Phi-3 (partial RoPE), Mistral, OLMo 2 — tiny random-weight configs, fp32, CPU.

For each: with room for everything, DynamicCache's greedy tokens; 300 tokens at budget 64 with evictions, the
policy's layers never above prompt + budget; a ragged batch gives each row's tokens run alone; the model's
RoPE as the policies use it (rotate, and its inverse) is the model's own; a user's policy subclass runs; a prompt
prefilled in chunks (sliding layers, sinks and all) gives DynamicCache's tokens keeping everything, and with
evictions each row's tokens run alone.
"""

from __future__ import annotations

import sys
import pytest
import torch

from beaconkv.hf import PolicyCache
from beaconkv.hf.hooks import decoder_layers
from beaconkv.hf.rotary import invert_rotary
from beaconkv.policies import BeaconKV, FullKV

from .helpers import NewestQuery, greedy, random_prompts

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)


def tiny_config(kind: str):
    """A tiny config of each architecture, with its quirks switched on."""
    if kind == "qwen3_moe":
        return tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                 num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "gpt_oss":  # attention sinks; sliding and full layers alternate; YaRN RoPE, one value per pair
        return tf.GptOssConfig(**{**COMMON, "intermediate_size": 64}, num_hidden_layers=4, head_dim=16,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                               layer_types=["sliding_attention", "full_attention"] * 2)
    if kind == "gemma3":  # three sliding layers, one full; its own query scale; RoPE per layer type
        return tf.Gemma3TextConfig(**COMMON, num_hidden_layers=4, head_dim=16, sliding_window=16,
                                   layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=24)
    if kind == "phi3":  # fused qkv, half the head rotated
        return tf.Phi3Config(**COMMON, num_hidden_layers=2, partial_rotary_factor=0.5)
    if kind == "mistral":
        return tf.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=None)
    if kind == "olmo2":  # q/k norms over the whole projection
        return tf.Olmo2Config(**COMMON, num_hidden_layers=2)
    raise ValueError(kind)


KINDS = ["qwen3_moe", "gpt_oss", "gemma3", "phi3", "mistral", "olmo2"]
SLIDING = {"gpt_oss": [0, 2], "gemma3": [0, 1, 2]}


@pytest.fixture(scope="module")
def models():
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        impl = "eager" if kind == "gpt_oss" else "sdpa"  # gpt-oss has no sdpa attention (its sinks)
        out[kind] = tf.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation=impl).float().eval()
    return out


def beacon() -> BeaconKV:
    return BeaconKV(64, n_recent=8, n_beacon=8)


@pytest.mark.parametrize("kind", KINDS)
def test_room_for_everything_gives_dynamic_cache_tokens(models, kind):
    model = models[kind]
    prompts = random_prompts((12, 30), seed=1)
    want = greedy(model, prompts, tf.DynamicCache(config=model.config), 40)
    assert greedy(model, prompts, PolicyCache(model, BeaconKV(512), max_new_tokens=40), 40) == want


@pytest.mark.parametrize("kind", KINDS)
def test_300_tokens_at_budget_64_stay_within_prompt_plus_budget(models, kind):
    model = models[kind]
    prompts, budget = random_prompts((12, 30), seed=2), 64
    cache = PolicyCache(model, beacon())
    assert [type(layer).__name__ for i, layer in enumerate(cache.layers) if i in SLIDING.get(kind, [])] == \
        ["DynamicSlidingWindowLayer"] * len(SLIDING.get(kind, []))
    peak = [0] * len(prompts)

    def watch(module, args, output):  # after the layer's write: the most its store holds this step
        index = cache.policy_index(module.layer_idx)
        if index is not None and cache.store is not None:
            for b, n in enumerate(cache.store[index].length.tolist()):
                peak[b] = max(peak[b], n)

    handles = [layer.self_attn.register_forward_hook(watch) for layer in decoder_layers(model)]
    try:
        tokens = greedy(model, prompts, cache, 300)
    finally:
        for h in handles:
            h.remove()
    assert [len(t) for t in tokens] == [300, 300]
    assert min(cache.state.stats.evictions) >= 20
    assert all(p <= len(prompt) + budget for p, prompt in zip(peak, prompts)), (peak, budget)
    assert peak == [len(prompt) + budget for prompt in prompts]
    assert cache.store.capacity == max(map(len, prompts)) + budget


@pytest.mark.parametrize("kind", KINDS)
def test_a_ragged_batch_equals_its_rows_run_alone(models, kind):
    model = models[kind]
    prompts = random_prompts((7, 26, 15), seed=3)
    batch = greedy(model, prompts, PolicyCache(model, beacon()), 300)
    assert batch == [greedy(model, [p], PolicyCache(model, beacon()), 300)[0] for p in prompts]


@pytest.mark.parametrize("kind", KINDS)
def test_the_policies_rope_is_the_models_own(models, kind):
    model = models[kind]
    attention = decoder_layers(model)[cache_full_layer(kind)].self_attn
    apply = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    rope = PolicyCache(model, beacon()).rope
    g = torch.Generator().manual_seed(4)
    D = rope.head_dim
    q = torch.randn(2, 4, 5, D, generator=g)
    positions = torch.randint(0, 900, (2, 5), generator=g)
    cos, sin = rope.cos_sin(q, positions)
    want = apply(q, q, cos, sin)[0]
    torch.testing.assert_close(rope.rotate(q, positions), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(invert_rotary(want, cos.unsqueeze(1), sin.unsqueeze(1), rope.layout), q,
                               atol=1e-5, rtol=0)
    per_head = positions[:, None].expand(2, 4, 5)  # every head at its own positions: the same here
    torch.testing.assert_close(rope.rotate(q, per_head), want, atol=1e-5, rtol=0)


def cache_full_layer(kind: str) -> int:
    """A full-attention layer of the tiny config."""
    return {"gpt_oss": 1, "gemma3": 3}.get(kind, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_users_policy_subclass_runs(models, kind):
    model = models[kind]
    prompts = random_prompts((10, 21), seed=5)
    policy = NewestQuery(64, n_recent=8, telemetry=True)
    cache = PolicyCache(model, policy)
    tokens = greedy(model, prompts, cache, 300)
    assert [len(t) for t in tokens] == [300, 300] and min(cache.state.stats.evictions) >= 20
    record = cache.state.stats.telemetry[-1]
    row = record.rows[0]
    generated = record.kept_positions[0][record.kept_positions[0] >= len(prompts[row])]
    # the score chose: some kept token is older than the newest B_min (what keeping the newest would keep)
    assert bool((generated < int(generated.max()) - policy.b_min + 1).any())


@pytest.mark.parametrize("kind", KINDS)
def test_a_chunked_prefill_keeps_the_models_own_layers_and_each_rows_tokens(models, kind):
    """The calls a chunked prompt is cut into run transformers' own layers (sliding windows) over the same columns
    as one prefill, and the policy's chunk attention applies gpt-oss's sinks: keeping everything, DynamicCache's
    tokens; evicting between chunks, a ragged batch gives each row's tokens run alone."""
    model = models[kind]
    prompts = random_prompts((12, 45, 30), seed=6)
    want = greedy(model, prompts, tf.DynamicCache(config=model.config), 20)
    assert greedy(model, prompts, PolicyCache(model, FullKV(), max_new_tokens=20, prefill_chunk=8), 20) == want

    def policy() -> BeaconKV:
        return BeaconKV(32, n_recent=4, n_beacon=4, n_prefix=2)

    cache = PolicyCache(model, policy(), prefill_chunk=8)
    batch = greedy(model, prompts, cache, 40)
    assert cache.store.capacity <= 2 + 32 + 8 < 45 and min(cache.state.stats.evictions) >= 3
    assert batch == [greedy(model, [p], PolicyCache(model, policy(), prefill_chunk=8), 40)[0] for p in prompts]
