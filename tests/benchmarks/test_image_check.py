"""scripts/image_check.sh checks, under the GPU image's packages, what scripts/gpu_bench.sh
runs: the same scripts and the same CUDA tests, so that neither drifts from the other."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
import time
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


def test_the_dry_run_expects_the_rows_the_stages_run():
    """image_check.sh asserts how many rows the dry run's batch and timeline saved: the batch
    stage's `rows=(...)` and step_timeline's ROWS, so that adding a row updates both."""
    from benchmarks.step_timeline import ROWS

    stages = (SCRIPTS / "gpu_bench.sh").read_text()
    check = (SCRIPTS / "image_check.sh").read_text()
    batch_rows = re.findall(r'"([^"]+)"', re.search(r"rows=\((.*?)\)", stages, re.S).group(1))
    assert f'len(batch["tok_per_s"]) == {len(batch_rows)},' in check
    assert f'len(timeline["rows"]) == {len(ROWS)},' in check


def test_gpu_bench_takes_every_setting_the_dry_run_gives_it():
    """The dry run (image_check.sh step 3) runs gpu_bench.sh on the CPU by its environment:
    a setting the script ignored would send the dry run to /tmp/pair, CUDA and the 8B's budget."""
    stages = (SCRIPTS / "gpu_bench.sh").read_text()
    check = (SCRIPTS / "image_check.sh").read_text()
    given = re.search(r"\n\s*(PATH=.*?)bash scripts/gpu_bench\.sh", check, re.S).group(1)
    names = set(re.findall(r"\b([A-Z_]+)=", given)) - {"PATH"}
    assert names == {
        "PAIR",
        "OUT",
        "DEVICE",
        "DTYPE",
        "KV_BUDGET",
        "MAX_LEN",
        "TOKENS",
        "REPEATS_ONE",
        "FUSED_MODES",
        "FUSED_DEADLINE",
    }
    for name in names:
        assert "${" + name + ":-" in stages, name


FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
case "$*" in *"${SLOW:-no such call}"*) echo $$ >> "$CALLS.slow"; sleep 30;; esac
case "$*" in *"$FAIL"*) echo failing; exit 3;; esac
printf 'rows  0%%|  | 0/6\rrows 17%%|# | 1/6\r          \rnoted while a bar ran (tqdm.write)\nrows 100%%|##| 6/6\n'
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


SCRIPTS_OF_ALL = [
    "fused_step",
    "cost_curve",
    "batch_scaling",
    "catch_up_anatomy",
    "test_static_cuda",
    "gpu_check",
    "test_static_ragged_cuda",
    "step_timeline",
]


def _called(tmp_path) -> list[str]:
    pattern = "|".join(SCRIPTS_OF_ALL)
    calls = (tmp_path / "calls").read_text().splitlines()
    return [re.search(rf"({pattern})\.py", c).group(1) for c in calls]


@pytest.mark.parametrize("fail", ["gpu_check.py", "test_static_ragged_cuda.py", "nothing"])
def test_the_tests_stage_keeps_the_most_when_a_part_fails_or_the_call_is_cut(tmp_path, fail):
    """`gpu_bench.sh tests` over a stand-in python3 and nvidia-smi: the padded path's CUDA tests,
    then gpu_check.py (what the simulator reads), then the ragged CUDA tests, whose compiles were
    never timed on a GPU; a part that fails costs none after it, and the stage then fails."""
    env = stand_ins(tmp_path, "H100", fail)
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "tests"], env=env, capture_output=True, text=True)
    assert _called(tmp_path) == ["test_static_cuda", "gpu_check", "test_static_ragged_cuda"]
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
    saved = (tmp_path / "out" / f"batch_scaling-{tag}.txt").read_text()
    # the progress bars left out, and what was written while one ran kept (its line follows
    # the bar's carriage returns)
    assert "noted while a bar ran (tqdm.write)\n1 passed" in saved and "%|" not in saved


def _stopped(tmp_path, grace_s: float = 5.0) -> bool:
    """Every slow stand-in the run started is gone, or dead and not yet reaped (a zombie: its
    parent was stopped with it, and a container's first process may not reap), within
    grace_s: the signal reaches it at once, but on a loaded machine it may take a moment to exit."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid in (tmp_path / "calls.slow").read_text().split() if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.05)


def _running(pid: str) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("slow", "deadline", "called", "kept"),
    [
        (None, "570", SCRIPTS_OF_ALL, 2),  # every stage whole
        ("fused_step.py", "3", ["fused_step"], 0),  # fused cut at the deadline: no time for the rest
        ("cost_curve.py", "3", SCRIPTS_OF_ALL[:2], 0),  # cost cut at the deadline: no time for batch
        ("batch_scaling.py", "3", SCRIPTS_OF_ALL[:3], 0),  # batch cut at the deadline: no time for tests
        ("gpu_check.py", "6", SCRIPTS_OF_ALL[:6], 1),  # tests cut in gpu_check: the padded tests kept
    ],
    ids=["whole", "fused-cut", "cost-cut", "batch-cut", "tests-cut"],
)
def test_all_runs_fused_cost_batch_then_tests_to_a_deadline_in_one_call(tmp_path, slow, deadline, called, kept):
    """`gpu_bench.sh all` over stand-ins: fused (compiled alone, rows skipped), cost, batch, then tests,
    then timeline with what is left of DEADLINE; a stage past it is stopped, the python it
    started included (no orphan holds the GPU), and the stage's files so far are kept; the call
    then fails with timeout's 124. (BATCH_DEADLINE set: at these deadlines the batch stage's
    own, what is left less 30 s, would leave no time for its anatomy.)"""
    env = stand_ins(tmp_path, "NVIDIA H200", "nothing to fail") | {
        "DEADLINE": deadline,
        "MIN_LEFT": "1",
        "BATCH_DEADLINE": "100",
    }
    if slow:
        env["SLOW"] = slow
    log = tmp_path / "log"
    with log.open("w") as sink:  # not a pipe: the run is over when the script is, orphans or not
        done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "all"], env=env, stdout=sink, stderr=sink)
    stopped, said = _stopped(tmp_path) if slow else True, log.read_text()
    assert _called(tmp_path) == called
    assert done.returncode == (0 if slow is None else 124), said
    out = tmp_path / "out"
    assert (out / "fused_step-h200-compiled.txt").exists()  # beside `fused`'s A/B, not over it
    assert (out / "batch_scaling-h200.txt").exists() == (slow not in ("fused_step.py", "cost_curve.py"))
    tests_log = out / "cuda_tests.txt"
    assert (tests_log.read_text().count("passed") if tests_log.exists() else 0) == kept
    assert stopped  # the stage's python went with it
    assert ("cut at the deadline" in said) == bool(slow)
    assert ("no time left for the tests stage" in said) == (
        slow in ("fused_step.py", "cost_curve.py", "batch_scaling.py")
    )
    assert ("no time left for the batch stage" in said) == (slow in ("fused_step.py", "cost_curve.py"))
    assert ("no time left for the cost stage" in said) == (slow == "fused_step.py")


def test_all_gives_each_stage_its_share_of_the_call(tmp_path):
    """What `all` hands each script: fused the compiled layers alone with its rows past 60 s
    skipped (cost and batch measure them), cost its HF baselines past 120 s skipped, every
    engine row at one stream 16 times, batch what is left of DEADLINE less 30 s; and the
    anatomy skipped where the batch stage has under ANATOMY_S left of its own deadline."""
    env = stand_ins(tmp_path, "NVIDIA H200", "nothing to fail") | {"DEADLINE": "400", "MIN_LEFT": "1"}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "all"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = {re.search(r"(\w+)\.py", c).group(1): c + " " for c in (tmp_path / "calls").read_text().splitlines()}
    assert (
        "--modes on --repeats-one 16 --deadline 60 " in calls["fused_step"]
        and "--tag h200-compiled " in calls["fused_step"]
    )
    assert "--repeats 16 --hf-repeats 3 --deadline 120 " in calls["cost_curve"]
    batch_deadline = int(re.search(r"--deadline (\d+)", calls["batch_scaling"]).group(1))
    assert 360 <= batch_deadline <= 370 and "--repeats-one 16 " in calls["batch_scaling"]
    assert "catch_up_anatomy" in calls
    env |= {"BATCH_DEADLINE": "50", "ANATOMY_S": "60"}  # under 60 s left of the batch stage's 50
    (tmp_path / "calls").unlink()
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "all"], env=env, capture_output=True, text=True)
    assert "no time left for catch_up_anatomy.py" in done.stdout and "catch_up_anatomy" not in _called(tmp_path)


@pytest.mark.parametrize("max_files", [8, 3])
def test_all_packs_its_logs_where_it_wrote_more_files_than_a_device_call_hands_back(tmp_path, max_files):
    """The stand-ins' run of `all` writes eight text files (and a file from before the call
    stays as it is): under the device's 8 nothing is packed; over MAX_FILES the call's logs go
    into all-TAG.tar.gz, JSON files and what was there before untouched."""
    env = stand_ins(tmp_path, "NVIDIA H200", "nothing to fail") | {"MAX_FILES": str(max_files), "MIN_LEFT": "1"}
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text("{}")  # committed before the call
    time.sleep(0.05)  # its mtime before the call's start, on a coarse clock too
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "all"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    logs = {
        "fused_step-h200-compiled.txt",
        "cost_curve-h200.txt",
        "batch_scaling-h200.txt",
        "catch_up_anatomy.txt",
        "cuda_tests.txt",
        "gpu.txt",
        "gpu_check.txt",
        "step_timeline.txt",
    }
    if max_files == 8:
        assert {p.name for p in out.iterdir()} == logs | {"plan.json"}
        return
    assert {p.name for p in out.iterdir()} == {"all-h200.tar.gz", "plan.json"}
    with tarfile.open(out / "all-h200.tar.gz") as archive:
        assert set(archive.getnames()) == logs
        assert b"1 passed" in archive.extractfile("step_timeline.txt").read()
    assert "8 files written, over the 3 a device call hands back: 8 packed into all-h200.tar.gz" in done.stdout
