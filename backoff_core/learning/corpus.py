"""Text corpora present on every machine without downloads.

No model hub or dataset server is reachable from our machines (DESIGN.md §5), so the
texts used for distilling the small model and for training routers come from the Python
installation itself:

- the standard library's own ``.py`` sources (code + docstrings + comments),
- the docstrings of those sources on their own (English prose, closer to chat text),
- ``pydoc_data.topics.topics`` (the language reference as plain English text).

Every function is deterministic: files are enumerated in sorted order and the
train / held-out split is a hash of the file's path *relative to the stdlib root*, so it
does not depend on where Python is installed nor on which other files exist. Held-out
texts are never used for training (the evaluation and the router's test split use them).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import pathlib
import sysconfig
from typing import Literal

import torch

Split = Literal["train", "heldout"]

# 1 file in 20 is held out. Small enough to leave most text for training, large enough
# (~35 files, ~0.6 MB of source) for evaluation with thousands of positions.
HELDOUT_PERCENT = 5

# Test suites are huge (~90% of the stdlib bytes), repetitive and unlike the text a chat
# model sees; encodings/ is mostly generated character-map tables; site-packages is not
# the standard library and differs between machines.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "encodings", "site-packages", "__pycache__"})


def _is_heldout(key: str) -> bool:
    """Stable split: sha1 of a key that names the text (not its contents or location)."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def _check_split(split: str) -> None:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def _stdlib_files() -> tuple[tuple[str, pathlib.Path], ...]:
    """(relative posix path, absolute path) of every eligible stdlib source, sorted."""
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS & set(rel.parts):
            continue
        files.append((rel.as_posix(), path))
    files.sort()
    return tuple(files)


def _read(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # a handful of files carry other encodings; skipping them is harmless


def stdlib_paths(split: Split = "train") -> list[str]:
    """Relative paths of the stdlib files in ``split`` (sorted)."""
    _check_split(split)
    want_heldout = split == "heldout"
    return [rel for rel, _ in _stdlib_files() if _is_heldout(rel) == want_heldout]


def _split_files(split: Split):
    """(relative path, path) of the stdlib files in ``split``, in sorted path order."""
    _check_split(split)
    want_heldout = split == "heldout"
    return [(rel, path) for rel, path in _stdlib_files() if _is_heldout(rel) == want_heldout]


def stdlib_texts(split: Split = "train") -> list[str]:
    """Full source text of each stdlib file in ``split``, in sorted path order."""
    texts = []
    for _, path in _split_files(split):
        text = _read(path)
        if text and text.strip():
            texts.append(text)
    return texts


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, nodes))
    return [doc for doc in docs if doc and len(doc) >= 40]  # drop one-word stubs


def stdlib_docstring_texts(split: Split = "train") -> list[str]:
    """One text per stdlib file: its docstrings joined by blank lines (English prose).

    Same file-level split as :func:`stdlib_texts`, so a held-out file's docstrings are
    held out too.
    """
    texts = []
    for _, path in _split_files(split):
        docs = _docstrings(_read(path) or "")
        if docs:
            texts.append("\n\n".join(docs))
    return texts


def pydoc_topics_texts(split: Split = "train") -> list[str]:
    """The pydoc reference topics, split by topic name, in sorted name order."""
    from pydoc_data.topics import topics  # part of the stdlib; imported lazily (0.5 MB)

    _check_split(split)
    want_heldout = split == "heldout"
    return [
        topics[name] for name in sorted(topics) if _is_heldout("pydoc:" + name) == want_heldout and topics[name].strip()
    ]


def corpus_texts(split: Split = "train") -> dict[str, list[str]]:
    """All sources by name; callers choose how to weight them."""
    return {
        "stdlib_source": stdlib_texts(split),
        "stdlib_docstrings": stdlib_docstring_texts(split),
        "pydoc_topics": pydoc_topics_texts(split),
    }


# ---------------------------------------------------------------------------------------
# Chat prompts: the instruct domain M_S and the routers serve. No chat dataset ships with
# Python, so prompts are built from templates × subjects; the responses come from M_L.
# ---------------------------------------------------------------------------------------

_GENERAL_SUBJECTS = (
    "the water cycle",
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "healthy sleep habits",
    "learning a new language",
    "the Roman Empire",
    "volcanoes",
    "climate change",
    "the human heart",
    "saving money",
    "the Moon landing",
    "machine learning",
    "honey bees",
    "the Great Wall of China",
    "baking bread",
    "electric cars",
    "the Renaissance",
    "vaccines",
    "ocean tides",
    "chess openings",
    "the periodic table",
    "time management",
    "rainbows",
    "the internet",
    "dinosaurs",
    "meditation",
    "the solar system",
    "coffee",
    "democracy",
    "earthquakes",
    "gardening",
    "the printing press",
    "recycling",
    "jazz music",
    "the immune system",
    "Mount Everest",
    "public speaking",
    "bicycles",
    "the stock market",
    "friendship",
    "penguins",
    "ancient Egypt",
    "running a marathon",
    "solar panels",
    "the Amazon rainforest",
    "writing a resume",
    "gravity",
    "the Olympic Games",
    "origami",
)

_GENERAL_TEMPLATES = (
    "Explain {s} in simple terms.",
    "Tell me three interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "What should a beginner know about {s}?",
    "Write a haiku about {s}.",
    "Give me a short summary of {s} for a ten-year-old.",
)

_PYTHON_TEMPLATES = (
    "What is {s} used for in Python?",
    "Explain {s} with a short example.",
    "Give me a short Python example that uses {s}.",
)


def _pydoc_titles() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    titles = []
    for name in sorted(topics):
        first = topics[name].strip().splitlines()[0].strip() if topics[name].strip() else ""
        if 3 <= len(first) <= 60:
            titles.append(("pydoc:" + name, first))
    return titles


def chat_prompts(split: Split = "train", kind: Literal["general", "python"] = "general") -> list[str]:
    """Deterministic user prompts (sorted by key) for the chat domain.

    ``general``: everyday questions (~300); ``python``: questions about pydoc topics and
    stdlib modules (~1700); questions about Unix commands: `backoff_core.learning.manpages`.
    Subjects are split like the texts (hash of the subject's key):
    a held-out stdlib file or pydoc topic yields only held-out prompts.
    """
    _check_split(split)
    want_heldout = split == "heldout"
    prompts: list[tuple[str, str]] = []
    if kind == "general":
        for subject in _GENERAL_SUBJECTS:
            key = "general:" + subject
            if _is_heldout(key) == want_heldout:
                prompts += [(key + t, t.format(s=subject)) for t in _GENERAL_TEMPLATES]
        prompts.sort()
        return [prompt for _, prompt in prompts]
    if kind != "python":
        raise ValueError(f"kind must be 'general' or 'python', got {kind!r}")
    python_subjects = [(key, title) for key, title in _pydoc_titles()]
    python_subjects += [
        (rel, f"the `{rel.removesuffix('.py').removesuffix('/__init__').replace('/', '.')}` module")
        for rel in stdlib_paths(split)
        # private modules (`_pydecimal`, `__phello__.spam`) make odd questions
        if not any(part.startswith("_") for part in rel.removesuffix("/__init__.py").split("/"))
    ]
    for key, subject in python_subjects:
        if _is_heldout(key) == want_heldout:
            prompts += [(key + t, t.format(s=subject)) for t in _PYTHON_TEMPLATES]
    prompts.sort()
    return [prompt for _, prompt in prompts]


# ---------------------------------------------------------------------------------------
# Prose that ships with the stdlib outside `.py` files: IDLE's NEWS / HISTORY / README,
# the licence, the email package's architecture notes, IDLE's HTML help (tags stripped).
# Not part of `corpus_texts` (so distillation corpora are unchanged): the routers keep it
# as a domain no model or router was trained on.
# ---------------------------------------------------------------------------------------

_NOTES_SUFFIXES = (".txt", ".rst", ".html")


def stdlib_notes_texts(split: Split = "train") -> list[str]:
    """Release notes, READMEs, licence and help pages of the stdlib (sorted path order).

    Split like the sources (hash of the relative path); with only ~12 files the held-out
    split is usually empty, so callers that need unseen prose use the whole set.
    """
    import html
    import re

    _check_split(split)
    root = stdlib_root()
    want_heldout = split == "heldout"
    texts = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix not in _NOTES_SUFFIXES or _EXCLUDED_DIRS & set(rel.parts) or "Grammar" in path.name:
            continue
        if _is_heldout("notes:" + rel.as_posix()) != want_heldout:
            continue
        text = _read(path)
        if not text:
            continue
        if path.suffix == ".html":
            text = re.sub(r"(?is)<(script|style).*?</\1>", "", text)
            text = html.unescape(re.sub(r"<[^>]+>", "", text))
            text = re.sub(r"\n\s*\n+", "\n\n", text)
        if len(text.strip()) >= 200:
            texts.append(text)
    return texts


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Texts tokenised and concatenated, each followed by EOS so no window hides a seam."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False).input_ids:
        ids += enc + [eos]
    return torch.tensor(ids, dtype=torch.long)  # [N]


def evenly_spaced_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """n non-overlapping windows spread over the whole stream: [n', seq_len], n' ≤ n."""
    n = min(n, len(stream) // seq_len)
    starts = torch.linspace(0, len(stream) - seq_len, n).long()
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])
