#!/usr/bin/env bash
# The whole GPU measurement in one call (issue 11's figures): build the random-weight pair with
# real shapes (../shared/gpu/make_pair.py, copied to gpu_pair/ beside this checkout and carried),
# run the CUDA test suite, the cost curve and the batch scaling, and leave every result in $OUT.
#
#   bash scripts/gpu_bench.sh [TAG]        # TAG names the GPU in the file names (default: h100)
#
# Needs: a CUDA GPU with ~40 GB free, torch + transformers + tqdm + matplotlib (no Ray, no gguf).
# Takes ~8 minutes on one H100 (pair ~30 s, CUDA tests ~1 min, graph capture at load, benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-h100}
out=${OUT:-benchmarks/results/gpu}
pair_src=${PAIR_SRC:-gpu_pair}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out" /tmp/pair
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$out/gpu.txt"
[ -d /tmp/pair/large ] || python "$pair_src/make_pair.py" /tmp/pair
python -m pytest -q -m cuda --tb=short -p no:cacheprovider tests/backoff_core/runners/test_static_cuda.py 2>&1 | tee "$out/cuda_tests.txt" | tail -5
common=(--small /tmp/pair/small --large /tmp/pair/large --device cuda --dtype bfloat16 --max-len 1024)
python benchmarks/cost_curve.py "${common[@]}" --kv-budget 65536 --max-tokens 64 --repeats 3 \
    --tag "$tag" --out "$out" 2>&1 | grep -v '%|' | tee "$out/cost_curve.txt" | tail -30
python benchmarks/batch_scaling.py "${common[@]}" --kv-budget 131072 --tokens 64 --repeats 2 \
    --tag "$tag" --out "$out" 2>&1 | grep -v '%|' | tee "$out/batch_scaling.txt" | tail -8
