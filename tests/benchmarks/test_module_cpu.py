"""benchmarks/module_cpu.py: its plugin's bookkeeping over a hand-written run (two modules
whose tests move a stand-in cgroup counter by known amounts), and the refusal without a
writable cgroup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import module_cpu

ROOT = Path(__file__).resolve().parents[2]
MODULE = """
from pathlib import Path
import pytest
USAGE = Path({usage!r})

def _move(n):
    USAGE.write_text(str(int(USAGE.read_text()) + n))

@pytest.fixture(scope="module")
def deployed():
    _move({setup})

def test_{name}_one(deployed):
    _move({first})

def test_{name}_two():
    _move({second})
"""


def test_each_module_is_charged_the_cpu_counted_from_its_first_test_to_the_next_modules(tmp_path):
    usage, out = tmp_path / "cpuacct.usage", tmp_path / "figures.tsv"
    usage.write_text(str(10**9))
    (tmp_path / "test_a.py").write_text(
        MODULE.format(usage=str(usage), name="a", setup=0, first=2 * 10**9, second=10**9)
    )
    (tmp_path / "test_b.py").write_text(
        MODULE.format(usage=str(usage), name="b", setup=4 * 10**9, first=5 * 10**8, second=0)
    )
    env = {"MODULE_CPU_USAGE": str(usage), "MODULE_CPU_OUT": str(out), "PATH": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.module_cpu"]
    done = subprocess.run([*cmd, "-p", "no:xdist", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    modules = [(Path(m).name, float(cpu)) for kind, m, _, cpu, *_ in rows if kind == "module"]
    assert modules == [("test_a.py", 3.0), ("test_b.py", 4.5)]  # b's fixture: 4 CPU-s in its first test's setup
    tests = [
        (t.split("::")[1], float(cpu), float(setup)) for kind, t, _, cpu, setup in (r for r in rows if r[0] == "test")
    ]
    assert tests == [
        ("test_a_one", 2.0, 0.0),
        ("test_a_two", 1.0, 0.0),
        ("test_b_one", 4.5, 4.0),
        ("test_b_two", 0.0, 0.0),
    ]
    assert all(float(r[2]) >= 0 for r in rows)
    record = module_cpu.summary(rows, cpus=2)
    assert (
        record["tests_cpu_s"] == 7.5 and record["setup_cpu_s"] == 4.0 and record["floor_min"] == round(7.5 / 2 / 60, 2)
    )
    assert [t["test"].split("::")[1] for t in record["tests"]] == [
        "test_b_one",
        "test_a_one",
        "test_a_two",
    ]  # >= 1 CPU-s
    assert record["ray"] == {"tests": 0, "cpu_s": 0.0, "setup_cpu_s": 0.0}  # no module here is marked ray


def test_without_a_writable_cgroup_it_says_so(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setattr(module_cpu, "CGROUPS", blocked)
    with pytest.raises(SystemExit, match="needs a writable cpuacct cgroup"):
        module_cpu.main(["--out", str(tmp_path / "out.json"), "tests/test_tiers.py"])


def test_the_summary_counts_the_ray_modules_tests_and_their_setups_apart():
    rows = [
        ["module", "tests/deployments/test_app_e2e.py", "50.0", "60.0"],
        ["test", "tests/deployments/test_app_e2e.py::test_http_unary_and_stream", "40.0", "50.0", "45.0"],
        ["test", "tests/deployments/test_app_e2e.py::test_openai_package_works_unchanged", "10.0", "10.0", "0.0"],
        ["module", "tests/test_tiers.py", "1.0", "0.5"],
        ["test", "tests/test_tiers.py::test_x", "1.0", "0.5", "0.25"],
    ]
    record = module_cpu.summary(rows, cpus=4)
    assert record["ray"] == {"tests": 2, "cpu_s": 60.0, "setup_cpu_s": 45.0}
    assert record["tests_cpu_s"] == 60.5 and record["setup_cpu_s"] == 45.2 and record["floor_min"] == 0.25
    assert [m["module"] for m in record["modules"]] == ["tests/deployments/test_app_e2e.py", "tests/test_tiers.py"]
    assert len(record["tests"]) == 2  # the 0.5 CPU-s test is under TEST_MIN_CPU_S
