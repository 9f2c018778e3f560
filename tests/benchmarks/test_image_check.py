"""scripts/image_check.sh checks, under the GPU image's packages, what scripts/gpu_bench.sh
runs: the same scripts and the same CUDA tests, so that neither drifts from the other."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[2] / "scripts"


def _files(text: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, text))


def test_the_image_check_covers_every_script_and_cuda_test_of_the_stages():
    stages = (SCRIPTS / "gpu_bench.sh").read_text()
    check = (SCRIPTS / "image_check.sh").read_text()
    run = _files(stages, r"python3 (benchmarks/\w+\.py)")
    assert {"benchmarks/gpu_check.py", "benchmarks/batch_scaling.py", "benchmarks/cost_curve.py"} <= run
    started = _files(re.search(r"for script in ([^;]+);", check).group(1), r"benchmarks/\w+\.py")
    assert started == run
    cuda_tests = _files(stages, r"tests/[\w/]+_cuda\.py")
    assert cuda_tests and cuda_tests == _files(check, r"tests/[\w/]+_cuda\.py")
    for path in run | cuda_tests:
        assert (SCRIPTS.parent / path).is_file(), path


def test_gpu_bench_takes_every_setting_the_dry_run_gives_it():
    """The dry run (image_check.sh step 3) runs gpu_bench.sh on the CPU by its environment:
    a setting the script ignored would send the dry run to /tmp/pair, CUDA and the 8B's budget."""
    stages = (SCRIPTS / "gpu_bench.sh").read_text()
    check = (SCRIPTS / "image_check.sh").read_text()
    given = re.search(r"\n\s*(PATH=.*?)bash scripts/gpu_bench\.sh", check, re.S).group(1)
    names = set(re.findall(r"\b([A-Z_]+)=", given)) - {"PATH"}
    assert names == {"PAIR", "OUT", "DEVICE", "DTYPE", "KV_BUDGET", "MAX_LEN", "TOKENS"}
    for name in names:
        assert "${" + name + ":-" in stages, name


FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in *"$FAIL"*) echo failing; exit 3;; esac
echo "1 passed"
"""


def stand_ins(tmp_path, gpu: str, fail: str) -> dict[str, str]:
    """The environment of a gpu_bench.sh run over a stand-in python3 (records its calls in
    $CALLS, fails those that name $FAIL) and nvidia-smi (names `gpu`), with a built pair."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text(FAKE_PYTHON)
    (bin_ / "nvidia-smi").write_text(f'#!/bin/sh\necho "{gpu}"\n')
    for tool in bin_.iterdir():
        tool.chmod(0o755)
    (tmp_path / "pair" / "large").mkdir(parents=True)
    (tmp_path / "pair" / "large" / "config.json").write_text("{}")
    return {
        **os.environ,
        "PATH": f"{bin_}:{os.environ['PATH']}",
        "PAIR": str(tmp_path / "pair"),
        "OUT": str(tmp_path / "out"),
        "CALLS": str(tmp_path / "calls"),
        "FAIL": fail,
    }


@pytest.mark.parametrize("fail", ["gpu_check.py", "test_static_ragged_cuda.py", "nothing"])
def test_the_tests_stage_keeps_the_most_when_a_part_fails_or_the_call_is_cut(tmp_path, fail):
    """`gpu_bench.sh tests` over a stand-in python3 and nvidia-smi: the padded path's CUDA tests,
    then gpu_check.py (what the simulator reads), then the ragged CUDA tests, whose compiles were
    never timed on a GPU; a part that fails costs none after it, and the stage then fails."""
    env = stand_ins(tmp_path, "H100", fail)
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "tests"], env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines()
    order = [re.search(r"(test_static_cuda|gpu_check|test_static_ragged_cuda)\.py", c).group(1) for c in calls]
    assert order == ["test_static_cuda", "gpu_check", "test_static_ragged_cuda"]
    assert (done.returncode == 0) == (fail == "nothing"), done.stdout + done.stderr
    assert (tmp_path / "out" / "cuda_tests.txt").read_text().count("passed") == 2 - (
        fail == "test_static_ragged_cuda.py"
    )


@pytest.mark.parametrize(
    ("gpu", "args", "tag"),
    [("NVIDIA H200", [], "h200"), ("NVIDIA H100 80GB HBM3", [], "h100"), ("NVIDIA H200", ["mine"], "mine")],
)
def test_the_files_are_named_by_the_gpu_they_ran_on(tmp_path, gpu, args, tag):
    """`gpu_bench.sh batch` over a stand-in python3 and nvidia-smi: the tag in the file names is
    the GPU's model unless one is given, so an H200's run never overwrites the H100's figures."""
    env = stand_ins(tmp_path, gpu, "nothing to fail")
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_bench.sh"), "batch", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    batch = next(c for c in (tmp_path / "calls").read_text().splitlines() if "batch_scaling.py" in c)
    assert f"--tag {tag} " in batch
    assert (tmp_path / "out" / f"batch_scaling-{tag}.txt").exists()
