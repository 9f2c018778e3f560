#!/usr/bin/env bash
# The GPU image's Python packages on this CPU, before a device's time is spent on them
# (docs/gpu.md, "Proven on the CPU"): the device runs torch 2.11 and transformers 5.17 with
# accelerate, pytest, tqdm and matplotlib only (no Ray, no gguf, no pydantic), where CI runs
# torch 2.13 and transformers 5.2x with every extra. In a venv of just those packages:
#
#   1. every script the three stages of scripts/gpu_bench.sh run starts (--help: its imports);
#   2. the CUDA tests the `tests` stage runs are collected (they skip here: no GPU);
#   3. the runners' and the benchmarks' tests pass, ragged catch-ups with FlexAttention
#      compiled by inductor among them (tests that need Ray skip).
#
#   bash scripts/image_check.sh        # or: make image-check
#
# The venv (IMAGE_VENV, default /tmp/backoff-image-venv) is built at the first call: torch's
# CUDA wheel and its nvidia packages, ~3 GB from the package index. TORCH and TRANSFORMERS pick
# other versions (a new image).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${IMAGE_VENV:-/tmp/backoff-image-venv}
torch_version=${TORCH:-2.11.0}
transformers_version=${TRANSFORMERS:-5.17.0}
py=$venv/bin/python
if ! "$py" -c "import torch, transformers, accelerate, pytest, tqdm, matplotlib
assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__
assert transformers.__version__ == '$transformers_version', transformers.__version__" 2>/dev/null; then
    echo "building $venv: torch $torch_version, transformers $transformers_version, accelerate, pytest, tqdm, matplotlib"
    python3.11 -m venv --clear "$venv"
    "$py" -m pip install -q "torch==$torch_version" "transformers==$transformers_version" accelerate pytest tqdm \
        matplotlib 2>&1 | { grep -v "^WARNING: Location" || true; }
fi
"$py" -c "import sys, torch, transformers; print(f'python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}')"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for script in benchmarks/gpu_check.py benchmarks/cost_curve.py benchmarks/batch_scaling.py benchmarks/catch_up_anatomy.py; do
    "$py" "$script" --help >/dev/null || { echo "$script does not start under the GPU image's packages" >&2; exit 1; }
done
echo "the stages' scripts start"
"$py" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/backoff_core/runners/test_static_cuda.py \
    tests/backoff_core/runners/test_static_ragged_cuda.py | tail -1
"$py" -m pytest -q -p no:cacheprovider --tb=short tests/backoff_core/runners tests/benchmarks "$@"
