#!/usr/bin/env bash
# The router pipeline on the embedded default pair, as run for issue 4 (CPU, ~40 min on 1
# shared core). Every step is resumable: rerunning skips finished shards / answers.
#
#   scripts/router_pipeline.sh            # everything
#   STEPS="train evaluate" scripts/router_pipeline.sh
#
# Domains: the router is (pre)trained on stdlib code and finetuned on the large model's
# answers to Python questions; calibrated on a disjoint 10% bucket of both; evaluated on
# their held-out splits. pydoc (reference docs), notes (the stdlib's release notes /
# READMEs / licence) and chat-general (everyday chat answers) are never used for
# training or calibration: the rate-control test runs there.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-runs/router}
T=${THREADS:-1}  # on a CPU shared with others, 1 thread beats 2 (OpenMP threads wait on each other)
STEPS=${STEPS:-"data train calibrate evaluate"}
backoff() { python -m backoff_core.cli "$@"; }

if [[ $STEPS == *data* ]]; then
  backoff router-data --out $R/pretrain --corpus stdlib:train --max-positions 24576 --threads $T
  backoff router-data --out $R/finetune --corpus chat-python:train --chat-samples 48 --max-positions 8192 --threads $T
  backoff router-data --out $R/calib --corpus stdlib:calib --corpus chat-python:calib --chat-samples 16 \
    --max-positions 4096 --threads $T
  backoff router-data --out $R/heldout --corpus stdlib:heldout --corpus chat-python:heldout --chat-samples 16 \
    --max-positions 6144 --threads $T
  backoff router-data --out $R/unseen-pydoc --corpus pydoc:train --max-positions 2048 --threads $T
  backoff router-data --out $R/unseen-notes --corpus notes:train --max-positions 2048 --threads $T
  backoff router-data --out $R/unseen-chat --corpus chat-general:train --chat-samples 16 --max-positions 2048 --threads $T
fi

if [[ $STEPS == *train* ]]; then
  for objective in binary regression buckets; do
    for layer in 0 1 2; do
      backoff router-train --data $R/pretrain --finetune $R/finetune --objective $objective --layer $layer \
        --out $R/heads/$objective-L$layer --threads $T
    done
  done
fi

if [[ $STEPS == *calibrate* ]]; then
  for head in $R/heads/*; do
    backoff router-calibrate --head $head --data $R/calib --threads $T
  done
fi

if [[ $STEPS == *evaluate* ]]; then
  HEAD=${HEAD:-$R/heads/regression-L2}
  backoff evaluate --run-dir $R/eval --head $HEAD --heldout $R/heldout --calib $R/calib \
    --unseen $R/unseen-pydoc --unseen $R/unseen-notes --unseen $R/unseen-chat \
    $(for h in $R/heads/*; do echo --compare $h; done) --threads $T
fi
