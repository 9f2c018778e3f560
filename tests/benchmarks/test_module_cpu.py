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
USAGE = Path({usage!r})

def test_{name}_one():
    USAGE.write_text(str(int(USAGE.read_text()) + {first}))

def test_{name}_two():
    USAGE.write_text(str(int(USAGE.read_text()) + {second}))
"""


def test_each_module_is_charged_the_cpu_counted_from_its_first_test_to_the_next_modules(tmp_path):
    usage, out = tmp_path / "cpuacct.usage", tmp_path / "figures.tsv"
    usage.write_text(str(10**9))
    (tmp_path / "test_a.py").write_text(MODULE.format(usage=str(usage), name="a", first=2 * 10**9, second=10**9))
    (tmp_path / "test_b.py").write_text(MODULE.format(usage=str(usage), name="b", first=5 * 10**8, second=0))
    env = {"MODULE_CPU_USAGE": str(usage), "MODULE_CPU_OUT": str(out), "PATH": ""}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.module_cpu"]
    done = subprocess.run([*cmd, "-p", "no:xdist", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:]
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    assert [(Path(m).name, float(cpu)) for m, _, cpu in rows] == [("test_a.py", 3.0), ("test_b.py", 0.5)]
    assert all(float(wall) >= 0 for _, wall, _ in rows)


def test_without_a_writable_cgroup_it_says_so(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setattr(module_cpu, "CGROUPS", blocked)
    with pytest.raises(SystemExit, match="needs a writable cpuacct cgroup"):
        module_cpu.main(["--out", str(tmp_path / "out.json"), "tests/test_tiers.py"])
