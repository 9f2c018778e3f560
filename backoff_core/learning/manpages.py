"""Unix manual pages (/usr/share/man, English sections 1, 5, 7, 8) as router text, and chat
prompts about their commands: reference prose and questions that no model or router here
was trained on. Not in `corpus.corpus_texts` either. Which pages exist depends on the
machine's packages; one tool family (the part of the name before the first '-', '_' or '.')
keeps at most MAN_FAMILY_CAP pages, so a suite with thousands of generated pages (a cloud
CLI) cannot make up the domain. Split like the other corpora (hash of section/name).
"""

from __future__ import annotations

import gzip
import hashlib
import pathlib
import re

from backoff_core.learning.corpus import Split, _check_split, _is_heldout

MAN_ROOT = pathlib.Path("/usr/share/man")
MAN_SECTIONS = ("man1", "man5", "man7", "man8")
MAN_FAMILY_CAP = 8
_PARAGRAPH_MACROS = frozenset({"PP", "P", "LP", "TP", "HP", "RS", "RE", "sp", "br", "nf", "fi", "EX", "EE"})
_JOINED_MACROS = frozenset({"BR", "BI", "IB", "IR", "RB", "RI"})  # alternating fonts, no spaces between
_TEXT_MACROS = frozenset({"B", "I", "SM", "SB", "SH", "SS", "IP", "UR", "MT"})


def _man_pages() -> list[tuple[str, pathlib.Path]]:
    """(section/name, path) of the pages kept (family cap applied), in sorted key order."""
    pages = []
    for section in MAN_SECTIONS:
        folder = MAN_ROOT / section
        if folder.is_dir():
            pages += [(f"{section}/{p.name}", p) for p in sorted(folder.iterdir()) if p.is_file()]
    if not pages:
        raise FileNotFoundError(
            f"no man pages under {MAN_ROOT}/{{{','.join(MAN_SECTIONS)}}} (a slim image drops them: install "
            "man-db and the packages' docs, or give the text as a path corpus)"
        )
    families: dict[str, int] = {}
    kept = []
    for key, path in sorted(pages, key=lambda kp: hashlib.sha1(kp[0].encode()).digest()):
        family = re.split(r"[-_.]", path.name, maxsplit=1)[0].lower()
        if families.get(family, 0) < MAN_FAMILY_CAP:
            families[family] = families.get(family, 0) + 1
            kept.append((key, path))
    return sorted(kept)


def _man_source(path: pathlib.Path) -> str | None:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    text = raw.decode("utf-8", errors="replace")
    return None if text.lstrip().startswith(".so ") else text  # a redirect to another page


def _man_inline(s: str) -> str:
    s = re.sub(r"\\f(\[[^\]]*\]|\(..|.)", "", s)  # font changes
    s = re.sub(r"\\s[+-]?\d", "", s)  # size changes
    s = re.sub(r"\\\*(\[[^\]]*\]|\(..|.)", "", s)  # string registers
    named = {"em": "—", "en": "–", "bu": "•", "aq": "'", "dq": '"', "lq": '"', "rq": '"', "co": "©", "rs": "\\"}
    s = re.sub(r"\\\((..)", lambda m: named.get(m.group(1), ""), s)
    s = s.replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ").replace("\\~", " ")
    return re.sub(r"\\[&,/|^)c]", "", s)


def man_to_text(source: str) -> str:
    """Plain text of a troff `man` page: requests dropped, their text kept, escapes resolved."""
    out: list[str] = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '.\\"')) or line.strip() in (".", "'"):
            continue
        if line.startswith((".", "'")):
            macro, _, args = line[1:].strip().partition(" ")
            words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', args)]
            if macro in _JOINED_MACROS:
                out.append(_man_inline("".join(words)))
            elif macro in _TEXT_MACROS and words:
                out.append(_man_inline(" ".join(words[:1] if macro == "IP" else words)))  # IP: tag, then indent
            elif macro in _PARAGRAPH_MACROS:
                out.append("")
            continue  # every other request (TH, ds, de, in, ...) prints nothing here
        out.append(_man_inline(line))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def man_texts(split: Split = "train") -> list[str]:
    """The text of each kept man page in ``split`` (hash of section/name), sorted by key.
    Like `notes`, nothing here is trained on: callers use the whole ``train`` split."""
    _check_split(split)
    want_heldout = split == "heldout"
    texts = []
    for key, path in _man_pages():
        if _is_heldout("man:" + key) != want_heldout:
            continue
        source = _man_source(path)
        text = man_to_text(source) if source else ""
        if len(text) >= 400:
            texts.append(text)
    return texts


def man_subjects(split: Split = "train") -> list[tuple[str, str]]:
    """(key, 'the `ls` command (list directory contents)') from the NAME lines of sections 1 and 8."""
    _check_split(split)
    want_heldout = split == "heldout"
    subjects = []
    for key, path in _man_pages():
        if not key.startswith(("man1/", "man8/")) or _is_heldout("man:" + key) != want_heldout:
            continue
        source = _man_source(path)
        m = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\s+\\?-\s+(.+)$", source or "", re.M)
        if not m:
            continue
        name = _man_inline(m.group(1)).split(",")[0].strip()
        what = _man_inline(m.group(2)).strip().rstrip(".")
        if re.fullmatch(r"[A-Za-z0-9][\w.+-]{0,30}", name) and 3 <= len(what) <= 80:
            subjects.append((key, f"the `{name}` command ({what})"))
    return subjects


UNIX_TEMPLATES = ("What does {s} do?", "Explain {s} with a short example.")


def unix_prompts(split: Split = "train") -> list[str]:
    """Deterministic user prompts about the commands of sections 1 and 8 (sorted by key)."""
    prompts = [(key + t, t.format(s=subject)) for key, subject in man_subjects(split) for t in UNIX_TEMPLATES]
    return [prompt for _, prompt in sorted(prompts)]
