"""Offline corpora: deterministic, non-empty, and train / held-out never overlap."""

from __future__ import annotations

import pytest

from backoff_core.learning import corpus


def test_stdlib_split_is_disjoint_and_covers_every_file():
    train, heldout = corpus.stdlib_paths("train"), corpus.stdlib_paths("heldout")
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(heldout) < 0.1 * len(train)
    assert not [p for p in train + heldout if p.split("/")[0] in ("test", "encodings")]


def test_texts_are_deterministic():
    assert corpus.stdlib_texts("heldout") == corpus.stdlib_texts("heldout")
    assert corpus.pydoc_topics_texts("train") == corpus.pydoc_topics_texts("train")


def test_every_source_has_train_and_heldout_text():
    for split in ("train", "heldout"):
        for source, texts in corpus.corpus_texts(split).items():
            assert texts and all(t.strip() for t in texts), (split, source)


def test_pydoc_topics_split_is_disjoint():
    train, heldout = corpus.pydoc_topics_texts("train"), corpus.pydoc_topics_texts("heldout")
    assert train and heldout and not set(train) & set(heldout)


@pytest.mark.parametrize("kind", ["general", "python"])
def test_chat_prompts_split_is_disjoint(kind):
    train, heldout = corpus.chat_prompts("train", kind), corpus.chat_prompts("heldout", kind)
    assert train and heldout and not set(train) & set(heldout)
    assert corpus.chat_prompts("train", kind) == train


def test_bad_split_is_rejected():
    with pytest.raises(ValueError):
        corpus.stdlib_texts("test")
