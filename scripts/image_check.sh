#!/usr/bin/env bash
# The GPU image's Python packages on this CPU, before a device's time is spent on them
# (docs/gpu.md, "Proven on the CPU"): the device runs torch 2.11 and transformers 5.17 with
# accelerate, pytest, tqdm and matplotlib only (no Ray, no gguf, no pydantic), where CI runs
# torch 2.13 and transformers 5.2x with every extra. In a venv of just those packages:
#
#   1. every script the stages of scripts/gpu_bench.sh run starts (--help: its imports);
#   2. the CUDA tests the `tests` stage runs are collected (they skip here: no GPU);
#   3. the stages `fused`, `cost`, `batch` and `timeline` of gpu_bench.sh, in the order `all`
#      runs them (`tests` needs a GPU), run end to end, the script itself, on the CPU over a tiny
#      random pair with the GPU pair's tokenizer (../shared/gpu/tok), 16 tokens, 2 repeats at
#      one stream: fused's compiled layers (inductor's C++ here) as `all` runs them (their rows
#      skipped) with HF's logits, every engine row of cost with
#      its routed share, every row of the batch stage measured with its routed share, none in
#      its `errors`, and every row of the timeline;
#   4. the runners' and the benchmarks' tests pass, ragged catch-ups with FlexAttention
#      compiled by inductor among them (tests that need Ray skip).
#
#   bash scripts/image_check.sh [PYTEST ARGS]     # or: make image-check
#
# (`tests` and gpu_check.py need a GPU: step 2 and the tests of step 4 cover what they import.)
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
for script in benchmarks/gpu_check.py benchmarks/fused_step.py benchmarks/cost_curve.py benchmarks/batch_scaling.py benchmarks/catch_up_anatomy.py \
    benchmarks/step_timeline.py benchmarks/served_gpu.py benchmarks/paper_pair.py; do
    "$py" "$script" --help >/dev/null || { echo "$script does not start under the GPU image's packages" >&2; exit 1; }
done
echo "the stages' scripts start"
"$py" -m pytest -q -p no:cacheprovider --collect-only -m cuda tests/backoff_core/runners/test_static_cuda.py \
    tests/backoff_core/runners/test_static_ragged_cuda.py tests/backoff_core/models/test_fp8_cuda.py | tail -1

tok=${GPU_TOKENIZER:-../shared/gpu/tok}
[ -f "$tok/tokenizer.json" ] || { echo "no $tok/tokenizer.json: ../shared/gpu/ beside the checkout" >&2; exit 2; }
dry=$(mktemp -d)
trap 'rm -rf "$dry"' EXIT
"$py" - "$tok" "$dry/pair" <<'PY'
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

tok = AutoTokenizer.from_pretrained(sys.argv[1])
shapes = {  # the real pair's kinds of shape, tiny: GQA, M_S's tied embeddings
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
    "large": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, tie_word_embeddings=False),
}
for name, shape in shapes.items():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, **shape)
    LlamaForCausalLM(config).save_pretrained(f"{sys.argv[2]}/{name}")
    tok.save_pretrained(f"{sys.argv[2]}/{name}")
PY
for stage in fused cost batch timeline; do
    PATH=$venv/bin:$PATH PAIR=$dry/pair OUT=$dry/out DEVICE=cpu DTYPE=float32 KV_BUDGET=16384 MAX_LEN=256 TOKENS=16 \
        REPEATS_ONE=2 FUSED_MODES=on FUSED_DEADLINE=1 bash scripts/gpu_bench.sh "$stage" dry >"$dry/$stage.txt" 2>&1 ||
        { cat "$dry/$stage.txt"; exit 1; }
    tail -1 "$dry/$stage.txt"
done
"$py" - "$dry/out" <<'PY'
import json
import sys

out = sys.argv[1]
batch = json.load(open(f"{out}/batch_scaling-dry.json"))
assert not batch["errors"], batch["errors"]
assert all(len(row) == 4 for row in batch["tok_per_s"].values()) and len(batch["tok_per_s"]) == 7, batch["tok_per_s"]
assert batch["ragged_rel_err"] < 1e-4, batch["ragged_rel_err"]  # float32: ragged logits are the padded path's
assert set(batch["routed_share"]) == set(batch["tok_per_s"]) and batch["repeats_one"] == 2, batch["routed_share"]
assert json.load(open(f"{out}/catch_up_anatomy.json"))
cost = json.load(open(f"{out}/cost_curve-dry.json"))
assert set(cost["routed_share"]) == {k for k in cost["per_token_s"] if not k.startswith("HF")} and cost["repeats"] == 2
assert {"17", "33", "128"} <= set(cost["P_L_s"]) and not cost["skipped"], cost["P_L_s"].keys()
fused = json.load(open(f"{out}/fused_step-dry.json"))
on = fused["modes"]["on"]  # as `all` runs it: the compiled layers alone, their rows skipped
assert on["compiled_after_rows"]["large"]["compiles"] > 0 and len(fused["skipped"]) == 12, fused
assert max(on["logits_rel_err"].values()) < 1e-4, on["logits_rel_err"]  # float32: HF's logits
timeline = json.load(open(f"{out}/step_timeline.json"))
assert all(row["x_first"] for row in timeline["rows"].values()) and len(timeline["rows"]) == 5, timeline["rows"].keys()
print(f"dry run of fused, cost, batch and timeline: {len(batch['tok_per_s'])} rows at n = 1 / 4 / 16 / 64, no errors")
PY
"$py" -m pytest -q -p no:cacheprovider --tb=short tests/backoff_core/runners tests/benchmarks "$@"
