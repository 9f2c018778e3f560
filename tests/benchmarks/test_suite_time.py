"""benchmarks/suite_time.py: a tier's record from its make run (a stand-in `make` that prints
a pytest summary and writes a JUnit file where PYTEST_ADDOPTS says), and the refusals."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks import suite_time

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.a.test_x" name="test_one" time="2.5"/>
<testcase classname="tests.a.test_x" name="test_two[p]" time="1.0"/>
<testcase classname="tests.b.test_y" name="test_three" time="4.0"/>
</testsuite></testsuites>"""
FAILED = JUNIT.replace(
    '<testcase classname="tests.b.test_y" name="test_three" time="4.0"/>',
    '<testcase classname="tests.b.test_y" name="test_three" time="4.0">'
    '<failure message="AssertionError: assert 3.4 &lt;= 3.0">trace</failure></testcase>',
)


def fake_make(returncode: int, tail: str, junit: str = JUNIT):
    calls = []

    def run(cmd, cwd, env, **kwargs):
        calls.append((cmd, env["PYTEST_ADDOPTS"]))
        xml = env["PYTEST_ADDOPTS"].split()[0].removeprefix("--junitxml=")
        with open(xml, "w") as f:
            f.write(junit)
        make = "make: *** [Makefile:30: test] Error 1\n" if returncode else ""
        return subprocess.CompletedProcess(cmd, returncode, stdout=f"....\n{tail}\n{make}")

    return run, calls


def test_a_tier_records_counts_slowest_tests_and_modules(monkeypatch):
    run, calls = fake_make(0, "3 passed, 1 skipped, 2 deselected, 5 warnings in 7.00s")
    monkeypatch.setattr(suite_time.subprocess, "run", run)
    row = suite_time.run_tier("fast", workers=2)
    assert calls[0][0] == ["make", "-s", "test-fast", "TEST_WORKERS=2"] and "-p no:cacheprovider" in calls[0][1]
    assert row["counts"] == {"passed": 3, "skipped": 1, "deselected": 2} and row["returncode"] == 0
    assert [s["test"] for s in row["slowest"]] == [
        "tests/b/test_y.py::test_three",
        "tests/a/test_x.py::test_one",
        "tests/a/test_x.py::test_two[p]",
    ]
    assert row["modules"] == [{"module": "tests/b/test_y.py", "s": 4.0}, {"module": "tests/a/test_x.py", "s": 3.5}]
    assert row["test_seconds_sum"] == 7.5 and row["goal_min"] == 3.0 and row["met"] is True
    assert row["failures"] == []


def test_a_failed_tier_is_not_met_and_main_says_so(monkeypatch, tmp_path):
    run, _ = fake_make(1, "1 failed, 2 passed, 1 error in 3.00s", FAILED)
    monkeypatch.setattr(suite_time.subprocess, "run", run)
    out = tmp_path / "suite.json"
    assert suite_time.main(["--tiers", "full", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["tiers"]["full"]
    assert row["counts"] == {"failed": 1, "passed": 2, "error": 1} and row["met"] is False
    assert row["failures"] == [
        {"test": "tests/b/test_y.py::test_three", "failure": "AssertionError: assert 3.4 <= 3.0"}
    ]
    assert row["target"] == "make test"


def test_a_tier_run_alone_keeps_the_other_tiers_record_and_the_file_is_replaced_at_the_end(monkeypatch, tmp_path):
    out = tmp_path / "suite.json"
    out.write_text(json.dumps({"tiers": {"fast": {"wall_min": 1.5}, "full": {"wall_min": 30.0}}}))
    seen = []
    run, _ = fake_make(0, "5 passed in 9.00s")

    def watched(cmd, **kwargs):
        seen.append(json.loads(out.read_text())["tiers"]["full"]["wall_min"])  # the old file while it runs
        return run(cmd, **kwargs)

    monkeypatch.setattr(suite_time.subprocess, "run", watched)
    assert suite_time.main(["--tiers", "full", "--out", str(out)]) == 0
    tiers = json.loads(out.read_text())["tiers"]
    assert seen == [30.0] and tiers["fast"] == {"wall_min": 1.5} and tiers["full"]["counts"] == {"passed": 5}
    assert not (tmp_path / "suite.partial.json").exists()


def test_an_unknown_tier_is_refused(capsys):
    with pytest.raises(SystemExit):
        suite_time.main(["--tiers", "fast,nightly"])
    assert "unknown tier(s) ['nightly']" in capsys.readouterr().err
