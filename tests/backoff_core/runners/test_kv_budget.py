"""The KV budget arithmetic of backoff_core/runners/kv_budget.py: bytes per token, `auto`
resolved on a (faked) device, the log line, and what a runner counts against it. The
serving side (eviction, refusals) is tests/deployments/serving/test_kv_budget.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backoff_core.runners import kv_budget
from backoff_core.runners.kv_budget import auto_budget, bytes_per_token, describe, kv_evictions, kv_tokens, resolve_kv
from backoff_core.types import KVSpec
from tests.support.tiny import tiny_model

GiB = 2**30


def fake_model(
    device: str = "cpu",
    element: int = 2,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int | None = 2,
    hidden: int = 256,
    head_dim: int | None = None,
):
    """Just what kv_budget reads: the config and the first parameter's device and size."""
    config = SimpleNamespace(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=hidden,
        head_dim=head_dim,
    )
    param = SimpleNamespace(device=torch.device(device), element_size=lambda: element)
    return SimpleNamespace(config=config, parameters=lambda: iter([param]))


def test_bytes_per_token_is_k_and_v_times_layers_kv_heads_head_dim_and_dtype():
    assert bytes_per_token(fake_model()) == 2 * 4 * 2 * 32 * 2  # head_dim = 256 / 8
    assert bytes_per_token(fake_model(head_dim=64)) == 2 * 4 * 2 * 64 * 2  # an explicit head_dim wins
    assert bytes_per_token(fake_model(kv_heads=None)) == 2 * 4 * 8 * 32 * 2  # no GQA: every head
    assert bytes_per_token(fake_model(element=4)) == 2 * bytes_per_token(fake_model())


def test_a_real_models_dtype_counts():
    small = tiny_model(1)  # 2 layers, 2 kv heads of 8, float32; not the shared fixture: it is cast
    assert bytes_per_token(small) == 2 * 2 * 2 * 8 * 4
    assert bytes_per_token(small.to(torch.bfloat16)) == 2 * 2 * 2 * 8 * 2


def test_auto_on_the_cpu_is_a_fraction_of_available_ram(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_ram", lambda: 10 * GiB)
    model = fake_model()
    assert auto_budget(model) == int(10 * GiB * kv_budget.RAM_FRACTION // bytes_per_token(model))
    assert auto_budget(model, gpu_share=0.25) == auto_budget(model)  # a GPU share means nothing here


@pytest.mark.parametrize("share, used", [(1.0, 1.0), (0.5, 0.5), (0.0, 1.0), (3.0, 1.0)])
def test_auto_on_cuda_is_a_fraction_of_free_memory_times_the_share(monkeypatch, share, used):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (8 * GiB, 80 * GiB))
    model = fake_model("cuda")
    assert auto_budget(model, share) == int(8 * GiB * kv_budget.GPU_FRACTION * used // bytes_per_token(model))


def test_resolve_auto_on_cuda_takes_static_whole_slots(monkeypatch):
    monkeypatch.setattr(kv_budget, "auto_budget", lambda model, share=1.0: 1000)
    model = fake_model("cuda")
    assert resolve_kv(model, "auto", max_len=64) == KVSpec(960, 64, True, True)  # 15 whole slots
    assert resolve_kv(model, "auto", max_len=4096) == KVSpec(4096, 4096, True, True)  # at least one slot
    assert resolve_kv(model, 1000, max_len=64, cuda_graphs=False) == KVSpec(1000, 64, False, True)  # as asked
    assert resolve_kv(model, "auto", max_len=64, static=False) == KVSpec(1000, 64, True, False)


def test_resolve_auto_on_the_cpu_takes_per_session_caches_unrounded(monkeypatch):
    monkeypatch.setattr(kv_budget, "auto_budget", lambda model, share=1.0: 1000)
    assert resolve_kv(fake_model(), "auto", max_len=64) == KVSpec(1000, 64, True, False)


def test_describe_names_the_budget_its_memory_and_storage():
    model = fake_model()  # 1024 bytes per token
    assert describe(KVSpec(2**20, 64, static=True), model) == "KV budget 1048576 tokens (1.00 GiB, static slots of 64)"
    assert (
        describe(KVSpec(3 * 2**19, 64, static=False), model)
        == "KV budget 1572864 tokens (1.50 GiB, per-session caches)"
    )


def test_a_runner_counts_whole_static_slots_or_its_own_positions():
    static = SimpleNamespace(kv=SimpleNamespace(slots=8, free_slots=5, max_len=64))
    assert kv_tokens(static) == 3 * 64
    assert kv_tokens(SimpleNamespace(kv_tokens=17, evictions=2)) == 17
    assert kv_evictions(SimpleNamespace(kv_tokens=17, evictions=2)) == 2
    assert (kv_tokens(SimpleNamespace()), kv_evictions(static)) == (0, 0)  # a remote proxy: nothing held here


def test_available_ram_falls_back_to_free_pages_without_proc_meminfo(monkeypatch):
    assert kv_budget.available_ram() > 0

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(kv_budget, "open", no_proc, raising=False)
    pages = kv_budget.os.sysconf("SC_PAGE_SIZE") * kv_budget.os.sysconf("SC_AVPHYS_PAGES")
    assert abs(kv_budget.available_ram() - pages) < 256 * 2**20  # free pages move a little between calls


def test_resolved_says_what_a_replicas_runner_became():
    """What LargeInfo / SmallInfo report as `resolved` (the served GPU stage records it)."""
    from backoff_core.runners.dynamic import ModelRunner
    from backoff_core.runners.kv_budget import resolved
    from backoff_core.runners.static import StaticRunner

    model = tiny_model(1)
    caches = resolved(ModelRunner(model, "large"), KVSpec(4096, static=False))
    assert (caches.device, caches.dtype, caches.static_kv, caches.kv_max_len, caches.cuda_graphs) == (
        "cpu", "float32", False, None, 0)  # fmt: skip
    static = resolved(StaticRunner(model, "large", kv_budget_tokens=512, max_len=128), KVSpec(512, 128))
    assert (static.static_kv, static.kv_budget_tokens, static.kv_max_len, static.cuda_graphs) == (True, 512, 128, 0)
    assert not static.compiled_layers and not static.ragged  # eager on the CPU
