#!/usr/bin/env bash
# The GPU measurement in stages, each one call of under 8 minutes on one H100 (docs/gpu.md):
#
#   bash scripts/gpu_bench.sh tests [TAG]   # pytest -m cuda (bf16 at G=3/4, hash vs CPU, SDPA kernel),
#                                           # the pair checked against the plan (gpu_check.json, its
#                                           # ragged forwards last), then the ragged catch-ups' CUDA
#                                           # tests (FlexAttention)
#   bash scripts/gpu_bench.sh fused [TAG]   # benchmarks/fused_step.py: compiled decoder layers vs eager,
#                                           # replays, kernel tables, rows at 1/16/64 streams, the goals
#   bash scripts/gpu_bench.sh cost  [TAG]   # benchmarks/cost_curve.py: c_S, P_L(k) (k 1..20 and 24..128),
#                                           # C(b), every engine row 16 times with its routed share,
#                                           # M_L alone over the card's spec bandwidth, HF baselines
#   bash scripts/gpu_bench.sh batch [TAG]   # benchmarks/batch_scaling.py: n = 1 (16 repeats), 4, 16, 64,
#                                           # seven rows (ROWS=all: every row), then catch_up_anatomy.py:
#                                           # every M_L forward of 64 streams
#   bash scripts/gpu_bench.sh timeline    # benchmarks/step_timeline.py: where 64 streams' wall time
#                                           # goes (forwards' device time, device idle, host profile)
#   bash scripts/gpu_bench.sh served [TAG]  # benchmarks/served_gpu.py: the Ray Serve app (SmallModel and
#                                           # LargeModel half the GPU each) beside the engine, HTTP and
#                                           # gRPC at 1/16/64 streams; needs the bundle of
#                                           # scripts/gpu_serve_bundle.sh carried as gpu_bundle/dist
#   bash scripts/gpu_bench.sh paper [TAG]   # benchmarks/paper_pair.py: the paper's pair (Llama-3.1-8B and
#                                           # -70B shapes, random weights built in process straight into
#                                           # fp8: no /tmp/pair), c_S, P_L(k), the cost curve with M_S fp8
#                                           # and bf16, 16 streams; then the fp8 CUDA tests (docs/fp8.md)
#   bash scripts/gpu_bench.sh all   [TAG]   # one device call: fused (compiled replays and kernel tables),
#                                           # cost, batch, then tests and timeline, each with what is
#                                           # left of DEADLINE seconds (default 540: under 9 minutes);
#                                           # over 8 files, the logs packed in one archive
#
# TAG names the GPU in the file names (default: its model from nvidia-smi, h100 or h200, say; a
# GPU without such a name: gpu), so an H200's run never overwrites an H100's figures. Every
# stage builds the random-weight 135M/8B-shaped pair in /tmp/pair itself (unless a warm machine
# kept it) from a copy of ../shared/gpu/ placed at gpu_pair/ beside this checkout's files
# (PAIR_SRC overrides), loads it once, and writes at most 6 files to $OUT (default
# benchmarks/results/gpu). Needs python3 with torch, transformers, tqdm and matplotlib (no Ray,
# no gguf) and ~30 GB of free GPU memory (benchmarks/results/gpu/plan.json: 24 GiB at these
# defaults). PAIR (a pair already built),
# DEVICE, DTYPE, KV_BUDGET, MAX_LEN and TOKENS override the defaults: scripts/image_check.sh
# runs `cost`, `batch` and `timeline` so, on the CPU with a tiny pair, before a GPU's time is
# spent on them. REPEATS: the batch stage's repeats of a cell past one stream (default 2; the
# median is kept); REPEATS_ONE: of a one-stream cell, there and in cost (default 16).
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
stage=${1:?usage: scripts/gpu_bench.sh tests|fused|cost|batch|timeline|served|paper|all [TAG]}
gpu_model() { # "NVIDIA H100 80GB HBM3" -> h100, "NVIDIA H200" -> h200, "NVIDIA L40S" -> l40s
    local model
    model=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
        grep -oE '\b[A-Z][0-9]{2,3}[A-Z]?\b' | head -1 || true)
    echo "${model:-gpu}" | tr '[:upper:]' '[:lower:]'
}
# progress bars out of the saved text: a bar redraws after a carriage return, and what the
# scripts print while one runs (tqdm.write) follows its last one; line-buffered, so that a
# stage cut at a deadline keeps its last lines; never a failure of its own (pipefail)
progress_out() { sed -u 's/.*\r//' | { grep --line-buffered -v '%|' || true; }; }
tag=${2:-$(gpu_model)}
out=${OUT:-benchmarks/results/gpu}
pair_src=${PAIR_SRC:-gpu_pair}
pair=${PAIR:-/tmp/pair}
tokens=${TOKENS:-64}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# inductor's compiled layers (KVSpec.compile, on by default on CUDA) cached across the stages'
# loads, and across calls of a warm machine (git-ignored: carry it)
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}
mkdir -p "$out"
if [ "$stage" = paper ]; then
    # no pair to build: the models are drawn in process; ~68 GiB for M_L, 8.5 + 15 GiB for the two
    # M_S; parts past PAPER_DEADLINE s skipped; SHAPE=tiny DEVICE=cpu is the dry run
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv >"$out/gpu.txt" 2>/dev/null || true
    rc=0
    python3 -m pytest -q -s -m cuda --tb=short -p no:cacheprovider tests/backoff_core/models/test_fp8_cuda.py \
        >"$out/fp8_cuda_tests-$tag.txt" 2>&1 || rc=$?
    tail -8 "$out/fp8_cuda_tests-$tag.txt"
    python3 benchmarks/paper_pair.py --shape "${SHAPE:-paper}" --device "${DEVICE:-cuda}" --tokens "$tokens" \
        --kv-budget "${KV_BUDGET:-20480}" --max-len "${MAX_LEN:-1024}" --deadline "${PAPER_DEADLINE:-420}" \
        --tag "$tag" --out "$out" 2>&1 | progress_out | tee "$out/paper_pair-$tag.txt" | tail -60
    [ "$rc" = 0 ] || { echo "fp8 CUDA tests failed (rc $rc)"; exit "$rc"; }
    exit 0
fi
if [ "$stage" = served ]; then
    # Ray Serve and the pair's source from the bundle (scripts/gpu_serve_bundle.sh): one tarball, or
    # two parts over two calls of a warm machine (the first call keeps part0 in /tmp and stops)
    bundle=${BUNDLE:-gpu_bundle/dist} unpacked=/tmp/serve-bundle
    if [ ! -f "$unpacked/site/manifest.json" ]; then
        if [ -f "$bundle/serve-bundle.tar.xz" ]; then
            mkdir -p "$unpacked" && xz -d <"$bundle/serve-bundle.tar.xz" | tar -C "$unpacked" -xf -
        elif [ -f "$bundle/serve-bundle.tar.xz.part1" ] && [ -f /tmp/serve-bundle.part0 ]; then
            mkdir -p "$unpacked" && cat /tmp/serve-bundle.part0 "$bundle/serve-bundle.tar.xz.part1" | xz -d | tar -C "$unpacked" -xf -
        elif [ -f "$bundle/serve-bundle.tar.xz.part0" ]; then
            cp "$bundle/serve-bundle.tar.xz.part0" /tmp/serve-bundle.part0
            echo "bundle part 0 kept in /tmp: call again at once (warm machine) carrying gpu_bundle/dist with part1 only"
            exit 0
        else
            echo "no bundle in $bundle: bash scripts/gpu_serve_bundle.sh here, carry gpu_bundle/dist" >&2
            exit 2
        fi
    fi
    export PYTHONPATH=$unpacked/site:$PYTHONPATH
    pair_src=${PAIR_SRC:-$unpacked/gpu_pair}
fi
if [ ! -f "$pair/large/config.json" ]; then
    [ -f "$pair_src/make_pair.py" ] || { echo "no $pair_src/make_pair.py: copy ../shared/gpu/ there" >&2; exit 2; }
    python3 "$pair_src/make_pair.py" "$pair"
fi
common=(--small "$pair/small" --large "$pair/large" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}"
    --kv-budget "${KV_BUDGET:-65536}" --max-len "${MAX_LEN:-1024}")
start=$SECONDS
case "$stage" in
tests)
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv >"$out/gpu.txt"
    # in this order, so that a call cut short keeps the most: the padded path's CUDA tests (18 s in
    # the third run), the pair against the plan with its probes (its load captures M_L's ragged
    # graphs, the default `auto`: FlexAttention's compiles, cached where `batch` ran first in the
    # same call; a failed one leaves the padded path), then the ragged CUDA tests
    pytest=(python3 -m pytest -q -s -m cuda --tb=short -p no:cacheprovider)
    rc=0 check=0
    "${pytest[@]}" tests/backoff_core/runners/test_static_cuda.py >"$out/cuda_tests.txt" 2>&1 || rc=$?
    tail -15 "$out/cuda_tests.txt"
    python3 benchmarks/gpu_check.py "${common[@]}" --out "$out" 2>&1 | progress_out | tee "$out/gpu_check.txt" |
        tail -60 || check=$?
    "${pytest[@]}" tests/backoff_core/runners/test_static_ragged_cuda.py >>"$out/cuda_tests.txt" 2>&1 || rc=$?
    tail -10 "$out/cuda_tests.txt"
    [ "$check" = 0 ] || { echo "gpu_check.py failed (rc $check)"; exit "$check"; }
    [ "$rc" = 0 ] || { echo "CUDA tests failed (rc $rc)"; exit "$rc"; }
    ;;
fused)
    # benchmarks/fused_step.py: the compiled decoder layers beside the eager ones, in one run: the
    # step graphs' replays and kernel tables, the logits against HF, the engine's rows at 1/16/64
    # streams, the goals (docs/gpu.md, "Compiled layers"); parts past FUSED_DEADLINE s are skipped
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv >"$out/gpu.txt" || true
    python3 benchmarks/fused_step.py "${common[@]}" --tokens "$tokens" --tag "$tag" --out "$out" \
        --modes "${FUSED_MODES:-on,off}" --repeats-one "${REPEATS_ONE:-16}" --deadline "${FUSED_DEADLINE:-420}" 2>&1 |
        progress_out | tee "$out/fused_step-$tag.txt" | tail -60
    ;;
cost)
    # the engine's rows first (each REPEATS_ONE generations, one stream), then the HF baselines,
    # each skipped where it would start past COST_DEADLINE s (none by default)
    python3 benchmarks/cost_curve.py "${common[@]}" --max-tokens "$tokens" --repeats "${REPEATS_ONE:-16}" \
        --hf-repeats 3 ${COST_DEADLINE:+--deadline "$COST_DEADLINE"} --tag "$tag" --out "$out" 2>&1 |
        progress_out | tee "$out/cost_curve-$tag.txt" | tail -32
    ;;
batch)
    # in this order, each row saved as it ends (a call cut short keeps the rows before): the goal's
    # row (the default: M_L's catch-ups ragged where their graphs were timed faster, which the load
    # captured, compiling FlexAttention, and checked), the same launched ahead (what `backoff
    # serve` runs on CUDA), then always-large (the goals under load are b=0.9 over it), then the
    # default's two choices alone (padded; ragged wherever they apply), then always-small and
    # always-small launched ahead (ROWS=all: every row of ROUTINGS, in flight among them). A row
    # that would start past BATCH_DEADLINE s is skipped (in the JSON's errors), and the anatomy
    # (a second load) runs only where ANATOMY_S (default 90) are left before it
    rows=("random b=0.9" "random b=0.9, launched ahead" "always-large" "random b=0.9, padded" "random b=0.9, ragged"
        "always-small" "always-small, launched ahead")
    [ "${ROWS:-}" = all ] && rows=()
    python3 benchmarks/batch_scaling.py "${common[@]}" --tokens "$tokens" --repeats "${REPEATS:-2}" \
        --repeats-one "${REPEATS_ONE:-16}" ${BATCH_DEADLINE:+--deadline "$BATCH_DEADLINE"} --tag "$tag" --out "$out" \
        ${rows[@]:+--rows "${rows[@]}"} 2>&1 | progress_out | tee "$out/batch_scaling-$tag.txt" | tail -14
    grep -h "relative error" "$out/batch_scaling-$tag.txt" || true # the ragged check, printed before the table
    if [ -n "${BATCH_DEADLINE:-}" ] && [ $((SECONDS - start)) -gt $((BATCH_DEADLINE - ${ANATOMY_S:-90})) ]; then
        echo "no time left for catch_up_anatomy.py (BATCH_DEADLINE $BATCH_DEADLINE s): run the batch stage alone"
    else
        # the shapes, real tokens and times of M_L's forwards behind the b=0.9 row (a second load)
        python3 benchmarks/catch_up_anatomy.py "${common[@]}" --out "$out" 2>&1 | progress_out |
            tee "$out/catch_up_anatomy.txt" | grep -v '^[DG][0-9]' | tail -8
    fi
    ;;
timeline)
    python3 benchmarks/step_timeline.py "${common[@]}" --tokens "$tokens" --out "$out" 2>&1 | progress_out |
        tee "$out/step_timeline.txt" | tail -100
    ;;
served)
    # benchmarks/served_gpu.py (docs/gpu.md, "The served path"): the engine's rows, then the app on a
    # local Ray, HTTP and gRPC through Serve's proxy; parts past SERVED_DEADLINE s skipped. An image
    # whose grpcio is older than the generated code's (gpu_bundle.py check: exit 3) runs HTTP alone.
    transports=(http grpc) check=0
    python3 scripts/gpu_bundle.py check "$unpacked/site" || check=$?
    [ "$check" = 3 ] && transports=(http) && echo "the image's grpcio is too old for clients/wire: HTTP alone"
    [ "$check" = 0 ] || [ "$check" = 3 ] || exit "$check"
    python3 benchmarks/served_gpu.py "${common[@]}" --tokens "$tokens" --tag "$tag" --out "$out" \
        --transports "${transports[@]}" --deadline "${SERVED_DEADLINE:-500}" 2>&1 | progress_out |
        tee "$out/served-$tag.txt" | tail -60
    ;;
all)
    # one device call (a loan's 15 minutes hold one call of 10 and the machine's start, and it goes
    # back 30 s after a call; a second call's start may take what is left), each stage with what is
    # left of DEADLINE seconds, the pair's build included (docs/gpu.md, "Measuring on a GPU"):
    #   1. fused, the compiled layers alone (FUSED_MODES=on; the eager A/B is `fused` alone), its
    #      engine rows skipped (FUSED_DEADLINE 60: cost and batch measure them): the pair's build,
    #      the cold compiles (their time), the step graphs' replays and kernel tables, the logits
    #      against HF; saved as fused_step-TAG-compiled.json, beside `fused`'s A/B;
    #   2. cost, its HF baselines skipped past COST_DEADLINE (120 s of its start): c_S, P_L(k),
    #      the b sweep and M_L alone, 16 generations a row, M_L alone over the spec bandwidth;
    #   3. batch, its rows to BATCH_DEADLINE (what is left less 30 s; the anatomy only with
    #      ANATOMY_S left): b=0.9, launched ahead, always-large first;
    #   4. tests and timeline with what is left (none under MIN_LEFT, 60 s): run them alone.
    # The inductor cache (.inductor-cache) the first stage fills serves the later stages' loads.
    # Each stage runs under `timeout`, which stops its whole process group; each writes as it
    # goes, so a stage cut short keeps what it wrote. The device hands back at most MAX_FILES (8)
    # files of $OUT: where the call wrote more, its text logs and plots go into one archive,
    # all-TAG.tar.gz (`tar xzf` it), and the JSON files stay as they are.
    deadline=${DEADLINE:-540} min_left=${MIN_LEFT:-60} rc=0
    stamp=$(mktemp) # what this call writes is newer
    for next in fused cost batch tests timeline; do
        left=$((deadline - SECONDS)) name=$tag
        if [ "$left" -lt "$min_left" ]; then
            echo "no time left for the $next stage ($left s of $deadline): run it alone"
            continue
        fi
        settings=()
        case $next in
        fused) settings=(FUSED_MODES=on FUSED_DEADLINE="${FUSED_DEADLINE:-60}") name=$tag-compiled ;;
        cost) settings=(COST_DEADLINE="${COST_DEADLINE:-120}") ;;
        batch) settings=(BATCH_DEADLINE="${BATCH_DEADLINE:-$((left - 30))}") ;;
        esac
        env "${settings[@]}" timeout --kill-after=10 "$left" bash "$self" "$next" "$name" || rc=$?
    done
    [ "$rc" = 124 ] && echo "a stage was cut at the deadline ($deadline s): what it wrote is kept"
    mapfile -t written < <(find "$out" -maxdepth 1 -type f -newer "$stamp" -printf '%f\n' | sort)
    rm -f "$stamp"
    if [ "${#written[@]}" -gt "${MAX_FILES:-8}" ]; then
        mapfile -t loose < <(printf '%s\n' "${written[@]}" | grep -v '\.json$')
        tar -czf "$out/all-$tag.tar.gz" -C "$out" "${loose[@]}" && (cd "$out" && rm -f "${loose[@]}")
        echo "${#written[@]} files written, over the ${MAX_FILES:-8} a device call hands back: ${#loose[@]} packed into all-$tag.tar.gz"
    fi
    echo "stage all: $SECONDS s in all"
    exit "$rc"
    ;;
*)
    echo "unknown stage $stage: tests, fused, cost, batch, timeline, served or all" >&2
    exit 2
    ;;
esac
echo "stage $stage: $((SECONDS - start)) s after the pair was ready"
