"""deployments/serving/models.py: a replica's ModelsConfig read into core's loading calls,
on tiny models saved to local directories (each replica loads only its own level)."""

from __future__ import annotations

import pytest
import torch

from deployments.serving.models import load_level, load_small_side
from deployments.serving.models_config import ModelsConfig
from tests.support.tiny import tiny_model


@pytest.fixture(scope="module")
def chain_dirs(tmp_path_factory, tokenizer):
    """small (hidden 32), medium (hidden 48, window 256), large (hidden 64): one tokenizer."""
    root = tmp_path_factory.mktemp("chain")
    dirs = {}
    for name, seed, hidden, window in (("small", 1, 32, 512), ("medium", 2, 48, 256), ("large", 3, 64, 512)):
        model = tiny_model(seed, hidden=hidden)
        model.config.max_position_embeddings = window
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _config(dirs, **extra) -> ModelsConfig:
    return ModelsConfig(
        small=dirs["small"], large=dirs["large"], medium=[dirs["medium"]], device="cpu", cpu_kernels="default", **extra
    )


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_small_side_holds_m_s_and_the_chains_shortest_window(chain_dirs, restore_threads):
    side = load_small_side(_config(chain_dirs), threads=1)
    assert side.hidden_size == 32 and side.model.config.hidden_size == 32
    assert side.context_window == 256  # the medium model's, read from its config alone
    assert torch.get_num_threads() == 1


def test_each_level_loads_its_own_model_alone(chain_dirs):
    cfg = _config(chain_dirs)
    assert [load_level(cfg, level).config.hidden_size for level in (1, 2)] == [48, 64]


def test_a_config_naming_one_model_of_a_pair_is_refused_before_loading(chain_dirs):
    with pytest.raises(ValueError, match="name both small and large"):
        ModelsConfig(small=chain_dirs["small"], device="cpu")


def test_a_missing_model_directory_is_a_clear_error(chain_dirs, tmp_path):
    cfg = ModelsConfig(small=chain_dirs["small"], large=str(tmp_path / "absent"), device="cpu")
    with pytest.raises((OSError, ValueError), match="absent"):
        load_level(cfg, 1)
