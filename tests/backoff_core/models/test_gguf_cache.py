"""The disk cache of converted GGUF models (backoff_core/models/gguf_cache.py).

The mechanics (keys, misses, races, broken entries, an unwritable root) run on the tiny
in-process model with a stand-in source file; one test converts the real default GGUF and
checks that the warm load is the cold one, weight for weight and token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from backoff_core.models import gguf_cache
from backoff_core.models.gguf_cache import CacheWarning, entry_key, file_sha256, load_converted, load_gguf, write_entry
from tests.support.tiny import tied_tiny, tiny_model


class Converter:
    """Counts conversions; the cache must call it exactly when it misses."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return tied_tiny()


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in " * 100)
    return path


def entries(root):
    return sorted(p.name for p in (root / "gguf").iterdir() if p.is_dir())


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_root_is_the_environment_variable_or_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("BACKOFF_CACHE_DIR", str(tmp_path))
    assert gguf_cache.cache_root() == tmp_path
    monkeypatch.delenv("BACKOFF_CACHE_DIR")
    assert gguf_cache.cache_root() == gguf_cache.DEFAULT_ROOT.expanduser()


def test_test_runs_never_use_the_users_cache():
    assert os.environ["BACKOFF_CACHE_DIR"] != str(gguf_cache.DEFAULT_ROOT.expanduser())


def test_second_load_reads_the_entry(tmp_path, source):
    convert = Converter()
    cold_model, cold_tok = load_converted(source, convert, tmp_path)
    warm_model, warm_tok = load_converted(source, convert, tmp_path)
    assert convert.calls == 1 and warm_model is not cold_model
    assert_same_model(cold_model, warm_model)
    assert warm_model.lm_head.weight.data_ptr() == warm_model.model.embed_tokens.weight.data_ptr()
    assert warm_tok("w1 w2 w7").input_ids == cold_tok("w1 w2 w7").input_ids
    assert entries(tmp_path) == [entry_key(file_sha256(source, tmp_path))]
    assert not [p for p in (tmp_path / "gguf").iterdir() if ".tmp-" in p.name]


def test_changed_file_misses_and_a_copy_hits(tmp_path, source):
    convert = Converter()
    load_converted(source, convert, tmp_path)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(source.read_bytes())
    load_converted(copy, convert, tmp_path)
    assert convert.calls == 1  # keyed by content, not path
    source.write_bytes(b"another GGUF " * 100)
    load_converted(source, convert, tmp_path)
    assert convert.calls == 2 and len(entries(tmp_path)) == 2


def test_the_hash_is_computed_once_per_file_version(tmp_path, source):
    real = file_sha256(source, tmp_path)
    hashes_file = tmp_path / "gguf" / "hashes.json"
    hashes = json.loads(hashes_file.read_text())
    hashes_file.write_text(json.dumps({k: "remembered" for k in hashes}))
    assert file_sha256(source, tmp_path) == "remembered"  # not read again
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert file_sha256(source, tmp_path) == real  # a new mtime is hashed again


def test_two_processes_loading_at_once_both_succeed_and_leave_one_entry(tmp_path, source):
    marks = tmp_path / "conversions"
    marks.mkdir()
    script = textwrap.dedent(f"""
        import os, pathlib, time
        from backoff_core.models.gguf_cache import load_converted
        from tests.support.tiny import slow_tied_tiny
        model, tok = load_converted(pathlib.Path({str(source)!r}),
                                    lambda: slow_tied_tiny(pathlib.Path({str(marks)!r})),
                                    pathlib.Path({str(tmp_path / "root")!r}))
        assert tok("w1 w2").input_ids == [3, 4]
        print("ok", float(model.lm_head.weight.sum()))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err.decode()[-2000:]
    sums = {out.decode().split()[-1] for out, _ in outs}
    assert len(sums) == 1  # the same weights in both
    assert len(list(marks.iterdir())) == 1  # the lock made the second wait and read
    root = tmp_path / "root"
    assert len(entries(root)) == 1
    assert not [p for p in (root / "gguf").iterdir() if ".tmp-" in p.name or ".trash-" in p.name]
    model, _ = gguf_cache.read_entry(root / "gguf" / entries(root)[0])
    assert_same_model(model, tied_tiny()[0])


def test_a_lost_publish_race_keeps_the_winners_entry(tmp_path):
    entry = tmp_path / "gguf" / "v1-x"
    winner, tok = tied_tiny()
    assert write_entry(entry, winner, tok, {"sha256": "x"})
    loser = tiny_model(9)  # different weights: must not replace the published ones
    assert not write_entry(entry, loser, tok, {"sha256": "x"})
    assert_same_model(gguf_cache.read_entry(entry)[0], winner)
    assert [p.name for p in entry.parent.iterdir()] == ["v1-x"]


def test_unwritable_root_warns_once_and_converts(tmp_path, source):
    root = tmp_path / "a-file"
    root.write_text("not a folder")
    convert = Converter()
    with pytest.warns(CacheWarning, match="not usable") as caught:
        model, _ = load_converted(source, convert, root)
    assert convert.calls == 1 and len(caught) == 1 and "\n" not in str(caught[0].message)
    assert_same_model(model, tied_tiny()[0])


def _truncate(entry):
    weights = entry / gguf_cache.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])


def _garble_header(entry):
    weights = entry / gguf_cache.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[8:40] = b"#" * 32  # same size, unreadable safetensors header
    weights.write_bytes(bytes(data))


def _drop_manifest(entry):
    (entry / gguf_cache.MANIFEST).unlink()  # a partial copy: files but no manifest


@pytest.mark.parametrize(
    "damage, says", [(_truncate, "manifest says"), (_garble_header, "header"), (_drop_manifest, None)]
)
def test_a_broken_entry_is_ignored_and_rebuilt(tmp_path, source, damage, says):
    convert = Converter()
    load_converted(source, convert, tmp_path)
    entry = tmp_path / "gguf" / entries(tmp_path)[0]
    damage(entry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = load_converted(source, convert, tmp_path)
    broken = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    if says is None:  # no manifest: an unfinished entry, rebuilt without a word
        assert broken == []
    else:
        assert len(broken) == 1 and "broken" in broken[0] and says in broken[0]
    assert convert.calls == 2
    assert_same_model(model, tied_tiny()[0])
    assert_same_model(gguf_cache.read_entry(entry)[0], model)  # the rebuilt entry is whole
    load_converted(source, convert, tmp_path)
    assert convert.calls == 2


@pytest.mark.real_pair
def test_warm_load_of_the_default_gguf_equals_the_cold_conversion(tmp_path, monkeypatch):
    """One real conversion (~20-40 s): the entry's model and tokenizer are transformers' own."""
    from backoff_core.models.default_pair import find_large_gguf

    path = find_large_gguf()
    cold, cold_tok = load_gguf(path, tmp_path)  # a miss: transformers' conversion itself
    assert hasattr(cold.config, "quantization_config")
    monkeypatch.setattr(gguf_cache, "convert_gguf", lambda p: pytest.fail("the warm load converted"))
    warm, warm_tok = load_gguf(path, tmp_path)
    assert_same_model(cold, warm)
    assert warm.lm_head.weight.data_ptr() == warm.model.embed_tokens.weight.data_ptr()
    skip = {"quantization_config", "_name_or_path"}
    assert {k: v for k, v in cold.config.to_dict().items() if k not in skip} == {
        k: v for k, v in warm.config.to_dict().items() if k not in skip
    }
    assert cold.generation_config.to_dict() == warm.generation_config.to_dict()

    assert type(warm_tok) is type(cold_tok) and len(warm_tok) == len(cold_tok) == 49152
    assert warm_tok.get_vocab() == cold_tok.get_vocab()
    assert warm_tok.all_special_tokens == cold_tok.all_special_tokens
    assert warm_tok.chat_template == cold_tok.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    texts = ["def add(a, b):\n    return a + b\n", "  Ünïcode spaces\tand <|im_end|> tokens", ""]
    for text in texts:
        assert warm_tok(text).input_ids == cold_tok(text).input_ids
        assert warm_tok.decode(cold_tok(text).input_ids) == cold_tok.decode(cold_tok(text).input_ids)
    enc = cold_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    warm_enc = warm_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(enc["input_ids"], warm_enc["input_ids"])
    with torch.inference_mode():
        a = cold.generate(**enc, max_new_tokens=16, do_sample=False)
        b = warm.generate(**enc, max_new_tokens=16, do_sample=False)
        torch.testing.assert_close(cold(a).logits, warm(a).logits, rtol=0, atol=0)
    assert torch.equal(a, b)
