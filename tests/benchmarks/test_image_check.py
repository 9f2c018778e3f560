"""scripts/image_check.sh checks, under the GPU image's packages, what scripts/gpu_bench.sh
runs: the same scripts and the same CUDA tests, so that neither drifts from the other."""

from __future__ import annotations

import re
from pathlib import Path

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
