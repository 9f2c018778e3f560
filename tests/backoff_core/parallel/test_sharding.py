"""The head layout of a tensor-parallel split (backoff_core/parallel/sharding.py): which sizes
a model's heads allow, the refusal's message, and each rank's tensors. No rank processes."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from backoff_core.parallel.ranks import RankSpec, TensorParallelRunner
from backoff_core.parallel.sharding import layout, shard, valid_sizes
from tests.support.tiny import tiny_model

# the default pair's M_L (SmolLM2-135M): 9 heads, 3 KV heads, MLP 1536
DEFAULT_LARGE = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)


def test_the_default_large_splits_over_three_ranks_and_refuses_two():
    lay = layout(DEFAULT_LARGE, "large", 3)
    assert (lay.heads_per_rank, lay.kv_per_rank, [lay.kv_head_range(r) for r in range(3)]) == (
        3,
        1,
        [(0, 1), (1, 2), (2, 3)],
    )
    with pytest.raises(ValueError) as refused:
        layout(DEFAULT_LARGE, "large", 2)
    message = str(refused.value)
    assert message.startswith(
        "large (llama, 32 layers, hidden 576): tensor_parallel=2 cannot split its 9 attention heads"
    )
    assert "and 3 KV heads" in message
    assert message.endswith("sizes that work: [1, 3]")  # 9 would split the heads, not the MLP: 1536 = 2^9 * 3


def test_kv_heads_are_replicated_where_the_ranks_outnumber_them():
    lay = layout(tiny_model(1).config, "large", 4)  # 4 heads, 2 KV heads
    assert (lay.heads_per_rank, lay.kv_per_rank) == (1, 1)
    assert [lay.kv_head_range(r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # q head r reads kv r // 2
    assert valid_sizes(4, 2, 64) == [1, 2, 4]
    with pytest.raises(ValueError, match="tensor_parallel=3 cannot split its 4 attention heads and 2 KV heads"):
        layout(tiny_model(1).config, "large", 3)


def test_other_architectures_are_refused_by_name():
    with pytest.raises(ValueError, match="model_type='qwen3'"):
        layout(Qwen3Config(num_attention_heads=4, num_key_value_heads=2), "large", 2)


def test_a_size_that_cannot_split_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="sizes that work: \\[1, 2, 4\\]"):
        TensorParallelRunner(tiny_model(1), RankSpec("large", 3))


def test_each_rank_holds_its_columns_rows_and_vocabulary_piece():
    model = tiny_model(1)  # hidden 32, 4 heads of 8, 2 KV heads, MLP 64, vocab 48
    pieces = [shard(model, "large", r, 2) for r in range(2)]
    state = model.state_dict()
    q, k, o = (state[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qko")
    down = state["model.layers.0.mlp.down_proj.weight"]
    for r, piece in enumerate(pieces):
        s = piece.state
        assert torch.equal(s["model.layers.0.self_attn.q_proj.weight"], q[16 * r : 16 * (r + 1)])  # 2 heads
        assert torch.equal(s["model.layers.0.self_attn.k_proj.weight"], k[8 * r : 8 * (r + 1)])  # 1 KV head
        assert torch.equal(s["model.layers.0.self_attn.o_proj.weight"], o[:, 16 * r : 16 * (r + 1)])
        assert torch.equal(s["model.layers.0.mlp.down_proj.weight"], down[:, 32 * r : 32 * (r + 1)])
        assert torch.equal(s["lm_head.weight"], state["lm_head.weight"][24 * r : 24 * (r + 1)])
        assert torch.equal(s["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
        cfg = piece.config
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (2, 1, 8, 32)


def test_an_uneven_vocabulary_pads_the_last_ranks_head_with_zeros():
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=47,
            hidden_size=24,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
    )
    head = model.lm_head.weight.detach()
    pieces = [shard(model, "large", r, 3).state["lm_head.weight"] for r in range(3)]
    assert [p.shape[0] for p in pieces] == [16, 16, 16]
    assert torch.equal(torch.cat(pieces)[:47], head) and not pieces[2][15].any()


def test_a_shard_packs_into_one_buffer_a_dtype_and_back():
    piece = shard(tiny_model(1), "large", 1, 2)
    packed = piece.packed()
    assert list(packed.flats) == [torch.float32] and len(packed.index) == len(piece.state)
    back = packed.unpack().state
    assert back.keys() == piece.state.keys() and all(torch.equal(back[k], piece.state[k]) for k in back)
