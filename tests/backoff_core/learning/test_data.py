"""router-data: per-position records against a direct, unbatched computation; chat
records route only the answer; shards resume."""

from __future__ import annotations

import pytest
import torch

from backoff_core.learning import data as router_data
from backoff_core.learning.data import DataConfig, build, load, make_windows
from backoff_core.learning.sources import load_documents, parse_spec
from backoff_core.models.loading import Chain
from backoff_core.sampling import entropy, kl_divergence
from tests.support.corpus import write_corpus
from tests.support.router_fakes import one_thread  # noqa: F401 (autouse fixture)


@pytest.fixture()
def built(tmp_path, pair, tokenizer):
    chain = Chain(tuple(pair), tokenizer, ("tiny-small", "tiny-large"))
    texts, chat = write_corpus(tmp_path)
    cfg = DataConfig(corpora=(texts, chat), seq_len=64, max_positions=400, batch_size=3, shard_windows=2)
    build(chain, cfg, tmp_path / "data")
    return chain, cfg, tmp_path / "data"


def test_records_match_a_direct_computation(built):
    chain, cfg, out = built
    small, large = chain.models
    data = load(out)
    windows = make_windows([load_documents(s, chain.tokenizer, out) for s in cfg.corpora], cfg)
    assert len(data) == sum(w.positions for w in windows) and len(data) > 100
    assert set(data.hidden) == {0, 1, 2} and data.hidden[1].shape == (len(data), small.config.hidden_size)
    for i, w in enumerate(windows):
        ids = torch.tensor([w.ids])
        with torch.no_grad():
            out_s = small(ids, output_hidden_states=True)
            logits_l = large(ids).logits[0]
        p = torch.arange(w.start, len(w.ids) - 1)
        mine = data.subset(data.window == i)
        assert mine.pos.tolist() == p.tolist()
        assert torch.allclose(mine.kl, kl_divergence(logits_l[p], out_s.logits[0, p]), atol=1e-4)
        assert torch.allclose(mine.ent_s, entropy(out_s.logits[0, p]), atol=1e-4)
        nll_l = -torch.log_softmax(logits_l[p], -1).gather(-1, ids[0, p + 1][:, None])[:, 0]
        assert torch.allclose(mine.nll_l, nll_l, atol=1e-4)
        assert torch.allclose(mine.hidden[1].float(), out_s.hidden_states[1][0, p], atol=1e-2)
        assert mine.token.tolist() == list(w.ids[w.start + 1 :])


def test_chat_records_route_only_the_answer(built):
    chain, cfg, out = built
    docs = load_documents(cfg.corpora[1], chain.tokenizer, out)
    assert all(d.start > 0 for d in docs)
    data = load(out)
    chat = data.subset(data.domain == 1)
    first = {int(w): int(chat.pos[chat.window == w].min()) for w in torch.unique(chat.window)}
    assert set(first.values()) <= {d.start for d in docs}


def test_shards_resume_and_configs_are_not_mixed(built, monkeypatch):
    chain, cfg, out = built
    before = load(out)
    (out / "shard-00001.safetensors").unlink()
    calls = []
    original = router_data.teacher_forced
    monkeypatch.setattr(router_data, "teacher_forced", lambda *a, **k: calls.append(1) or original(*a, **k))
    build(chain, cfg, out)
    assert len(calls) == 1  # only the missing shard was recomputed
    after = load(out)
    assert torch.equal(before.kl, after.kl) and torch.equal(before.hidden[2], after.hidden[2])
    with pytest.raises(ValueError, match="another config"):
        build(chain, DataConfig(corpora=cfg.corpora, seq_len=32), out)


def test_bad_specs_are_user_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in domain"):
        parse_spec(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="unknown split"):
        parse_spec("stdlib:test")
    assert parse_spec("pydoc") == ("pydoc", "train")
    with pytest.raises(FileNotFoundError, match="no router data"):
        load(tmp_path)


def test_a_head_scores_stored_positions_as_the_engine_does(built):
    """data_scores (training, calibration, evaluation) == ClassifierHead.score on live tensors."""
    from backoff_core.learning.train import TrainConfig, data_scores, train

    chain, cfg, out = built
    data = load(out)
    head, _ = train(
        TrainConfig(
            layer=2, objective="buckets", inner_size=8, epochs=1, finetune_epochs=0, features=("entropy", "max_prob")
        ),
        data,
    )
    w = make_windows([load_documents(s, chain.tokenizer, out) for s in cfg.corpora], cfg)[0]
    with torch.no_grad():
        o = chain.models[0](torch.tensor([w.ids]), output_hidden_states=True)
    p = torch.arange(w.start, len(w.ids) - 1)
    live = head.score(o.hidden_states[2][0, p], o.logits[0, p])
    assert torch.allclose(data_scores(head, data.subset(data.window == 0)), live, atol=2e-3)
    with pytest.raises(ValueError, match="reads M_S's logits"):
        head.score(o.hidden_states[2][0, p])


def test_loading_several_dirs_drops_repeated_windows(built):
    chain, cfg, out = built
    once = load(out)
    import shutil

    shutil.copytree(out, out.parent / "copy")
    twice = load([out, out.parent / "copy"])
    assert len(twice) == len(once) and twice.domains[0].startswith("data/")


def test_every_position_names_its_document_and_windows_of_one_document_share_it(built):
    chain, cfg, out = built
    data = load(out)
    windows = make_windows([load_documents(s, chain.tokenizer, out) for s in cfg.corpora], cfg)
    for i, w in enumerate(windows):
        assert set(data.doc[data.window == i].tolist()) == {w.doc}
    texts = load_documents(cfg.corpora[0], chain.tokenizer, out)
    assert max(w.doc for w in windows if w.domain == 0) < len(texts) <= min(w.doc for w in windows if w.domain == 1)
    two = [d for d in {w.doc for w in windows} if sum(w.doc == d for w in windows) == 2]
    assert two  # windows_per_doc = 2 cut some document twice: one id for both


def test_data_without_document_ids_reads_as_one_document_a_window(built):
    from safetensors.torch import load_file, save_file

    chain, cfg, out = built
    for shard in out.glob("shard-*.safetensors"):  # as router-data wrote shards before `doc`
        tensors = load_file(str(shard))
        del tensors["doc"]
        save_file(tensors, str(shard))
    data = load([out, out])  # two dirs: ids stay distinct across them
    assert torch.equal(data.doc, data.window)
