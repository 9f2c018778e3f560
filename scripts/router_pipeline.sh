#!/usr/bin/env bash
# The router pipeline on the embedded default pair (CPU, ~95 min on 1 shared core: data ~25,
# heads ~20, evaluation ~50). Every step is resumable: rerunning skips finished shards / answers.
#
#   scripts/router_pipeline.sh            # everything
#   STEPS="train evaluate" scripts/router_pipeline.sh
#
# Domains: the router is (pre)trained on stdlib code and finetuned on the large model's
# answers to Python questions; calibrated on a disjoint 10% bucket of both (the calibration set
# also picks which head ships); evaluated on their held-out splits. Never used to train or
# calibrate a router ("unseen"): pydoc (reference docs) and chat-general (everyday chat
# answers), both seen by M_S's distillation; notes (the stdlib's release notes / READMEs /
# licence), manpages (the machine's Unix man pages) and chat-unix (answers about those
# commands), which neither model nor router was trained on. Evaluation data takes one window
# per document where documents are plenty, so the bootstrap over documents has many.
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-runs/router}
T=${THREADS:-1}  # on a CPU shared with others, 1 thread beats 2 (OpenMP threads wait on each other)
STEPS=${STEPS:-"data train calibrate evaluate"}
# M_S's hidden layers (0 = embeddings .. its depth = the last layer's output); the heads read LAYER.
DEPTH=$(python -c "from backoff_core.models.default_pair import read_student_config as c; print(c()['num_hidden_layers'])")
LAYER=${LAYER:-4}  # the shipped head's (backoff_core/assets/router)
SWEEP=${SWEEP:-full}  # full: every head below; shipped: the shipped recipe (joint_head, i64) on each of M_S's layers
backoff() { python -m backoff_core.cli.main "$@"; }

if [[ $STEPS == *data* ]]; then
  backoff router-data --out $R/pretrain --corpus stdlib:train --max-positions 24576 --threads $T
  backoff router-data --out $R/pretrain-b --corpus stdlib:train --seed 1 --max-positions 24576 --threads $T
  backoff router-data --out $R/finetune-b --corpus chat-python:train --chat-samples 144 --max-positions 16384 --threads $T
  backoff router-data --out $R/calib --corpus stdlib:calib --corpus chat-python:calib --chat-samples 16 \
    --max-positions 4096 --threads $T
  backoff router-data --out $R/heldout --corpus stdlib:heldout --corpus chat-python:heldout --chat-samples 96 \
    --max-positions 16384 --windows-per-doc 1 --threads $T
  backoff router-data --out $R/unseen-pydoc --corpus pydoc:train --max-positions 8192 --windows-per-doc 1 --threads $T
  backoff router-data --out $R/unseen-notes --corpus notes:train --max-positions 6144 --threads $T  # 11 documents
  backoff router-data --out $R/unseen-chat --corpus chat-general:train --chat-samples 64 --max-positions 8192 \
    --threads $T
  backoff router-data --out $R/unseen-man --corpus manpages:train --max-positions 16384 --windows-per-doc 1 \
    --threads $T
  backoff router-data --out $R/unseen-chat-unix --corpus chat-unix:train --chat-samples 96 --max-positions 8192 \
    --threads $T
fi

PRE="--data $R/pretrain --data $R/pretrain-b --finetune $R/finetune-b"
# the shipped recipe: one stage over all three corpora, buckets, M_S's layer $1 + features, $2 inner units
joint_head() {
  backoff router-train --data $R/pretrain --data $R/pretrain-b --data $R/finetune-b --finetune-epochs 0 \
    --epochs 15 --objective buckets --layer "$1" --features entropy,max_prob --inner-size "$2" \
    --out $R/heads/buckets-L$1-feat-joint-i$2 --threads $T
}
if [[ $STEPS == *train* && $SWEEP == shipped ]]; then
  for layer in $(seq 1 "$DEPTH"); do joint_head "$layer" 64; done
elif [[ $STEPS == *train* ]]; then
  for objective in binary regression buckets; do
    for layer in $(seq 0 "$DEPTH"); do  # the paper's head: hidden state only (Figure 4 sweeps the layer)
      backoff router-train $PRE --objective $objective --layer $layer --out $R/heads/$objective-L$layer --threads $T
    done
    # + M_S's entropy and top probability from the step's logits
    backoff router-train $PRE --objective $objective --layer $LAYER --features entropy,max_prob \
      --out $R/heads/$objective-L$LAYER-feat --threads $T
    # one stage over all three corpora at once (no finetune stage)
    backoff router-train --data $R/pretrain --data $R/pretrain-b --data $R/finetune-b --finetune-epochs 0 \
      --epochs 15 --objective $objective --layer $LAYER --features entropy,max_prob \
      --out $R/heads/$objective-L$LAYER-feat-joint --threads $T
  done
  for inner in 64 128 256; do joint_head "$LAYER" "$inner"; done  # smaller heads: as good, cheaper per step
fi

if [[ $STEPS == *calibrate* ]]; then
  for head in $R/heads/*; do
    backoff router-calibrate --head $head --data $R/calib --threads $T
  done
fi

if [[ $STEPS == *evaluate* ]]; then
  HEAD=${HEAD:-$R/heads/buckets-L$LAYER-feat-joint-i64}  # the committed run: HEAD=backoff_core/assets/router
  ARGS="--head $HEAD --heldout $R/heldout --calib $R/calib --unseen $R/unseen-pydoc --unseen $R/unseen-notes
    --unseen $R/unseen-chat --unseen $R/unseen-man --unseen $R/unseen-chat-unix --control-requests 16 --threads $T"
  # three parts side by side (a core each; the teacher-forced part is computed by each), then one run
  pids=()
  backoff evaluate --run-dir $R/eval-a $ARGS $(for h in $R/heads/*; do echo --compare $h; done) \
    --skip control --skip open_horizon --skip speed --max-tokens 24 --rate-grid 0.3,0.5,0.7,0.9,0.95 \
    --grid-routers classifier,entropy,random & pids+=($!)
  backoff evaluate --run-dir $R/eval-b $ARGS --skip generation --skip layers --skip open_horizon & pids+=($!)
  backoff evaluate --run-dir $R/eval-c $ARGS --skip generation --skip layers --skip control --skip speed \
    --open-requests 16 --open-tokens 128 & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done  # set -e: a failed part stops here
  backoff evaluate-merge --part $R/eval-a --part $R/eval-b --part $R/eval-c --run-dir $R/eval
fi
