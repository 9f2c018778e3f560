"""Man pages as router text (backoff_core/learning/manpages.py): troff to text, redirects
skipped, a tool family capped, prompts about the commands, a clear error without pages."""

from __future__ import annotations

import pytest

from backoff_core.learning import manpages

PAGE = r""".\" a comment the reader never sees
.TH LS 1 "2022" "GNU coreutils" "User Commands"
.SH NAME
ls \- list directory contents
.SH DESCRIPTION
.PP
List information about the \fBFILE\fRs \(em the current directory by default.
.TP
.BR \-a ", " \-\-all
do not ignore entries starting with .
.IP "\fB\-l\fP" 4
use a long listing format
"""


def test_a_man_page_reads_as_its_text():
    text = manpages.man_to_text(PAGE)
    assert text.splitlines()[:2] == ["NAME", "ls - list directory contents"]
    assert "List information about the FILEs — the current directory by default." in text
    assert "-a, --all" in text and "-l\nuse a long listing format" in text
    assert "comment" not in text and "\\f" not in text and ".TH" not in text


@pytest.fixture
def man_root(tmp_path, monkeypatch):
    import gzip

    for section, name, page in (
        ("man1", "ls.1.gz", PAGE),
        ("man8", "pwck.8.gz", PAGE.replace("ls \\- list directory contents", "pwck \\- verify password files")),
        ("man1", "lsattr.1.gz", ".so man1/ls.1"),  # a redirect: no text of its own
    ):
        (tmp_path / section).mkdir(exist_ok=True)
        (tmp_path / section / name).write_bytes(gzip.compress((page + "\n" + "more prose. " * 40).encode()))
    for i in range(manpages.MAN_FAMILY_CAP + 3):  # one tool family with many generated pages
        (tmp_path / "man1" / f"gcloud-thing{i}.1").write_text(
            PAGE.replace("ls \\-", f"gcloud-thing{i} \\-") + "x " * 300
        )
    monkeypatch.setattr(manpages, "MAN_ROOT", tmp_path)
    return tmp_path


def test_man_pages_skip_redirects_and_cap_a_family(man_root):
    keys = [key for key, _ in manpages._man_pages()]
    assert "man1/ls.1.gz" in keys and "man8/pwck.8.gz" in keys
    assert sum(k.startswith("man1/gcloud") for k in keys) == manpages.MAN_FAMILY_CAP
    texts = manpages.man_texts("train") + manpages.man_texts("heldout")
    assert len(texts) == len(keys) - 1  # the .so redirect has no text
    assert manpages.man_texts("train") == manpages.man_texts("train")


def test_unix_chat_prompts_ask_about_the_commands_of_the_man_pages(man_root):
    prompts = manpages.unix_prompts("train") + manpages.unix_prompts("heldout")
    assert "What does the `pwck` command (verify password files) do?" in prompts
    assert not set(manpages.unix_prompts("train")) & set(manpages.unix_prompts("heldout"))


def test_no_man_pages_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(manpages, "MAN_ROOT", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="no man pages under"):
        manpages.man_texts("train")
