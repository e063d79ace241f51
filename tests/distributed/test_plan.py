"""The sharding plan: each rank's heads, MLP columns and vocabulary rows, and the checkpoint slices it reads."""

from __future__ import annotations

import dataclasses

import pytest

from beaconkv.distributed import ShardPlan, TensorParallelError, check_tensor_parallel_size
from beaconkv.distributed.plan import TensorSlice
from beaconkv.models.config import ModelConfig


def config(heads: int = 8, kv: int = 2, inter: int = 96, vocab: int = 97, hd: int = 16) -> ModelConfig:
    return ModelConfig("qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=inter, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, qk_norm=True)


def test_kv_heads_split_when_there_are_enough():
    plans = [ShardPlan(config(heads=8, kv=4), 2, r) for r in range(2)]
    assert [p.kv_heads for p in plans] == [range(0, 2), range(2, 4)]
    assert [p.attention_heads for p in plans] == [range(0, 4), range(4, 8)]  # whole GQA groups
    assert [p.output_heads for p in plans] == [range(0, 4), range(4, 8)]
    assert all(p.replicas == 1 and p.is_first_replica for p in plans)
    local = plans[1].local_config()
    assert (local.num_attention_heads, local.num_key_value_heads, local.intermediate_size) == (4, 2, 48)
    assert (local.vocab_size, local.head_dim, local.hidden_size) == (97, 16, 64)


def test_fewer_kv_heads_than_ranks_replicate_each_kv_head():
    """2 KV heads on 4 ranks: ranks 0-1 hold KV head 0 and its 4 query heads, each projecting 2 of them."""
    plans = [ShardPlan(config(heads=8, kv=2), 4, r) for r in range(4)]
    assert [p.replicas for p in plans] == [2] * 4
    assert [p.kv_heads for p in plans] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [p.attention_heads for p in plans] == [range(0, 4), range(0, 4), range(4, 8), range(4, 8)]
    assert [p.output_heads for p in plans] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [p.is_first_replica for p in plans] == [True, False, True, False]
    # together the ranks project every query head once
    assert sorted(h for p in plans for h in p.output_heads) == list(range(8))


def test_tensor_slices_and_their_checkpoint_shapes():
    plan = ShardPlan(config(heads=8, kv=2), 4, 3)  # KV head 1 (replicated), query heads 4..7, o_proj heads 6..7
    hd = 16
    layer = "model.layers.1."
    cases = {
        layer + "self_attn.q_proj.weight": ((0, 4 * hd, 8 * hd), (4 * hd, 64), (8 * hd, 64)),
        layer + "self_attn.k_proj.weight": ((0, hd, 2 * hd), (hd, 64), (2 * hd, 64)),
        layer + "self_attn.v_proj.bias": ((0, hd, 2 * hd), (hd,), (2 * hd,)),
        layer + "self_attn.o_proj.weight": ((1, 6 * hd, 8 * hd), (64, 2 * hd), (64, 8 * hd)),
        layer + "mlp.gate_proj.weight": ((0, 72, 96), (24, 64), (96, 64)),
        layer + "mlp.down_proj.weight": ((1, 72, 96), (64, 24), (64, 96)),
        "model.embed_tokens.weight": ((0, 73, 97), (24, 64), (97, 64)),  # 97 rows: 25, 24, 24, 24
        "lm_head.weight": ((0, 73, 97), (24, 64), (97, 64)),
    }
    for name, ((dim, start, stop), local, stored) in cases.items():
        s = plan.tensor_slice(name)
        assert (s.dim, s.start, s.stop) == (dim, start, stop), name
        assert plan.stored_shape(name, local) == stored, name
    for replicated in (layer + "self_attn.q_norm.weight", layer + "input_layernorm.weight", "model.norm.weight"):
        assert plan.tensor_slice(replicated) is None
        assert plan.stored_shape(replicated, (16,)) == (16,)
    whole = dataclasses.replace(plan, vocab_parallel=False)
    assert whole.tensor_slice("lm_head.weight") is None and whole.vocab == range(97)


def test_vocabulary_parts_cover_it_once():
    for size in (1, 2, 4):
        plans = [ShardPlan(config(), size, r) for r in range(size)]
        assert [i for p in plans for i in p.vocab] == list(range(97))
        assert plans[0].vocab_lengths == [len(p.vocab) for p in plans]


def test_an_uneven_split_gives_the_first_ranks_one_head_more():
    """The embedded SmolLM2-135M's shape (9 query heads, 3 KV heads) over 2 ranks: 2 KV heads and 1."""
    plans = [ShardPlan(config(heads=9, kv=3, inter=1536), 2, r) for r in range(2)]
    assert [p.kv_heads for p in plans] == [range(0, 2), range(2, 3)]
    assert [p.attention_heads for p in plans] == [range(0, 6), range(6, 9)]
    assert [p.output_heads for p in plans] == [range(0, 6), range(6, 9)]
    assert [p.intermediate for p in plans] == [range(0, 768), range(768, 1536)]
    assert plans[1].kv_head_counts == [2, 1]
    assert plans[1].local_config().num_attention_heads == 3
    assert plans[1].tensor_slice("model.layers.0.self_attn.o_proj.weight") == TensorSlice(1, 6 * 16, 9 * 16)


def test_sizes_the_model_cannot_split_are_refused_with_the_ones_it_can():
    with pytest.raises(TensorParallelError, match=r"3 ranks are more than its num_key_value_heads=2 and not a "
                                                  r"multiple of them.*use one of 1, 2, 4, 8\."):
        check_tensor_parallel_size(config(heads=8, kv=2), 3)
    with pytest.raises(TensorParallelError, match=r"num_attention_heads=6 is not a multiple of 4"):
        check_tensor_parallel_size(config(heads=6, kv=2), 4)  # 2 replicas of each KV head, 3 query heads each
    check_tensor_parallel_size(config(heads=24, kv=4), 3)  # 2, 1 and 1 KV heads
    with pytest.raises(TensorParallelError, match="must be an int >= 1"):
        check_tensor_parallel_size(config(), 0)
    with pytest.raises(TensorParallelError, match=r"rank=2 is outside \[0, size=2\)"):
        ShardPlan(config(), 2, 2)


def test_describe_names_the_rank_and_its_share():
    line = ShardPlan(config(heads=8, kv=2), 4, 1).describe()
    assert line.startswith("rank 1/4: KV heads 0..0 (1 of 2, replicated x2), query heads 0..3 (o_proj 2..3)")
    assert "MLP 24 of 96, vocab 25..48" in line


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(("heads", "kv", "size"), [(8, 4, 2), (8, 2, 4), (9, 3, 2), (8, 2, 1)])
def test_parameters_are_what_the_rank_builds(kind, heads, kv, size):
    """The arithmetic count equals the parameters of the rank's model built on the meta device."""
    import torch

    from beaconkv.distributed.group import TensorParallel
    from beaconkv.distributed.layers import attention_factory, mlp_factory, use_vocab_parallel
    from beaconkv.models import build_model

    for tied in (True, False):
        for vocab_parallel in (True, False):
            c = dataclasses.replace(config(heads=heads, kv=kv, inter=96), model_type=kind, qk_norm=kind == "qwen3",
                                    attention_bias=kind == "qwen2", tie_word_embeddings=tied)
            for rank in range(size):
                plan = ShardPlan(c, size, rank, vocab_parallel)
                tp = TensorParallel(None, rank, size)
                with torch.device("meta"):
                    model = build_model(plan.local_config(), attention=attention_factory(plan, tp),
                                        mlp=mlp_factory(tp))
                    if vocab_parallel:
                        use_vocab_parallel(model, plan, tp)
                built = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
                assert plan.parameters == built, (tied, vocab_parallel, rank)
    assert ShardPlan(config(heads=8, kv=2), 4, 0).kv_bytes_per_token() == 2 * 2 * 1 * 16 * 2
