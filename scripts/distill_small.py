"""Distil the default small model M_S from the large model M_L (DESIGN.md §5).

M_S = a few Llama decoder layers between M_L's own token embeddings and its final norm +
LM head, which M_S shares and which stay frozen. Only the decoder layers are trained, to
minimise

    KL(p_L ‖ p_S)  (+ hidden_weight · ‖h_S − h_L‖² / ‖h_L‖²  on the final normed states)

on windows of offline text (scripts/distill_data.py). The layers start as copies of evenly
spaced M_L layers (--layers N), or of the ones named by --layers-init; --grow-from DIR puts
an existing student's trained layers at evenly spaced slots instead and starts the other
slots as M_L layers whose residual branches output zero, so the grown student computes
exactly what DIR's did at step 0. Deterministic given --seed on a machine.

    python scripts/distill_small.py --steps 600 --seed 0 --out runs/s2/final --run-dir runs/s2
    python scripts/distill_small.py --resume --run-dir runs/s2 [--steps 1200]   # after a stop

A run directory keeps the teacher labels (teacher.pt), the latest checkpoint (ckpt.pt,
every --ckpt-every steps, on Ctrl-C / SIGTERM and at --stop-after-minutes) and the student
with the best held-out KL so far (best/, loadable by scripts/eval_small.py --student-dir).
At the last step --out gets model.safetensors (M_S's own layers, fp16), config.json,
train_log.json, loss_curve.png and MODEL_CARD.md (scripts/eval_small.py --card fills in
its quality section).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import signal
import sys
import time

import torch
from safetensors.torch import load_file
from tqdm import tqdm

if not __package__:  # run as a script: the checkout's packages (scripts, backoff_core) importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from backoff_core.models.default_pair import (
    SHARED_PREFIXES,
    STUDENT_DIR,
    STUDENT_WEIGHTS,
    build_small,
    large_layer_state,
    load_default_large,
    read_student_config,
    save_small,
)
from scripts.distill_data import (
    SOURCE_WEIGHTS,
    build_streams,
    distill_loss,
    heldout_kl,
    label_with_teacher,
    sample_windows,
    teacher_hidden,
)
from scripts.distill_report import plot_curves, reproduce_command, write_model_card
from scripts.eval_small import heldout_windows

# Options a resumed run takes from its checkpoint (they define the run); the others
# (length, threads, cadence, where to write) may change between sessions.
# --out is the run's: a resumed run must not fall back to the default (the shipped M_S).
SESSION_OPTIONS = ("steps", "threads", "eval_every", "ckpt_every", "stop_after_minutes", "run_dir", "resume", "device")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="student optimiser steps")
    p.add_argument("--teacher-windows", type=int, default=2048, help="training windows labelled once by M_L")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--more-labels",
        default=None,
        help="comma-separated run dirs whose teacher labels join this run's training windows",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    p.add_argument("--hidden-weight", type=float, default=1.0, help="weight of the normalised MSE of final states")
    p.add_argument("--kl-positions", type=int, default=512, help="positions per batch with the full KL (0: all)")
    p.add_argument("--keep-weight", type=float, default=0.0, help="extra KL weight where M_S's entropy is low")
    p.add_argument("--keep-entropy", type=float, default=2.0, help="nats: 'low' for --keep-weight")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (0: torch's default)")
    p.add_argument("--layers", type=int, default=2, help="student depth, initialised from evenly spaced M_L layers")
    p.add_argument("--layers-init", default=None, help="comma-separated M_L layers instead (sets depth)")
    p.add_argument("--grow-from", type=pathlib.Path, default=None, help="a student dir whose layers seed the slots")
    p.add_argument("--chat-samples", type=int, default=320, help="M_L answers to train chat prompts (0: none)")
    p.add_argument("--chat-tokens", type=int, default=128, help="max tokens per answer")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=6, help="held-out windows per source")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--stop-after-minutes", type=float, default=None, help="checkpoint and stop (resume later)")
    p.add_argument("--run-dir", type=pathlib.Path, default=None, help="checkpoints; default <out>.run")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--out", type=pathlib.Path, default=STUDENT_DIR)
    p.add_argument("--device", default="auto", help="auto: cuda if available, else cpu")
    args = p.parse_args(argv)
    args.run_dir = args.run_dir or args.out.with_name(args.out.name + ".run")
    return args


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------------
# The student's starting point
# ---------------------------------------------------------------------------------------


def evenly_spaced(n: int, total: int) -> list[int]:
    """n indices spread over 0..total-1, both ends included."""
    return [round(i * (total - 1) / (n - 1)) for i in range(n)] if n > 1 else [0]


def init_student(large, args):
    """(M_S in train mode, a sentence saying how it was initialised)."""
    layers_init = (
        [int(i) for i in args.layers_init.split(",")]
        if args.layers_init
        else evenly_spaced(args.layers, large.config.num_hidden_layers)
    )
    state = large_layer_state(large, layers_init)
    init = f"copies of M_L layers {layers_init}"
    if args.grow_from:
        own = load_file(args.grow_from / STUDENT_WEIGHTS)
        n_own = read_student_config(args.grow_from)["num_hidden_layers"]
        slots = evenly_spaced(n_own, len(layers_init))
        for j, slot in enumerate(slots):
            for name, t in own.items():
                if name.startswith(f"model.layers.{j}."):
                    state[name.replace(f"layers.{j}.", f"layers.{slot}.", 1)] = t
        for slot in set(range(len(layers_init))) - set(slots):
            # residual branches that add zero: the new layer is the identity until trained
            state[f"model.layers.{slot}.self_attn.o_proj.weight"].zero_()
            state[f"model.layers.{slot}.mlp.down_proj.weight"].zero_()
        init = (
            f"the {n_own} trained layers of {args.grow_from} at slots {slots}, the other slots "
            f"M_L layers {[layers_init[s] for s in range(len(layers_init)) if s not in slots]} "
            "with zeroed o_proj / down_proj (the grown student starts as the old one)"
        )
    small = build_small(large, state, len(layers_init)).train()
    return small, layers_init, init


# ---------------------------------------------------------------------------------------
# Run directory: teacher labels, checkpoints, best student
# ---------------------------------------------------------------------------------------


def atomic_save(obj, path: pathlib.Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint whole


def own_state(small) -> dict[str, torch.Tensor]:
    return {n: t.detach().cpu().clone() for n, t in small.state_dict().items() if not n.startswith(SHARED_PREFIXES)}


def teacher_data(large, tokenizer, args, device) -> dict:
    """Training windows + M_L labels + held-out monitor windows, computed once per run dir."""
    path = args.run_dir / "teacher.pt"
    if path.is_file():
        print(f"teacher labels from {path}")
        return torch.load(path)
    t_chat = time.time()
    streams = build_streams(large, tokenizer, args)
    chat_minutes = (time.time() - t_chat) / 60 if args.chat_samples else 0.0
    val_x = list(heldout_windows(tokenizer, args.seq_len, args.eval_windows).values())
    g = torch.Generator().manual_seed(args.seed)
    t_teacher = time.time()
    train_x = sample_windows(streams, args.teacher_windows, args.seq_len, g)  # [N, T]
    train_h = label_with_teacher(large, train_x, args.batch_size, "M_L labels")  # [N, T, d] fp16
    data = {
        "train_x": train_x,
        "train_h": train_h,
        "val_x": val_x,
        "val_h": [teacher_hidden(large, x.to(device)).half().cpu() for x in val_x],
        "stream_tokens": {s: len(t) for s, t in streams.items()},
        "source_weights": {s: w for s, w in SOURCE_WEIGHTS.items() if s in streams},
        "chat_minutes": chat_minutes,
        "teacher_minutes": (time.time() - t_teacher) / 60,
    }
    atomic_save(data, path)
    return data


def add_more_labels(data: dict, run_dirs: str | None) -> dict:
    """This run's training windows plus those of other run dirs (their own M_L labels, reused):
    more teacher tokens for the price of one new teacher pass. Held-out windows stay this run's."""
    if not run_dirs:
        return data
    xs, hs = [data["train_x"]], [data["train_h"]]
    minutes = {"teacher_minutes": data["teacher_minutes"], "chat_minutes": data["chat_minutes"]}
    for run_dir in run_dirs.split(","):
        labels = pathlib.Path(run_dir) / "teacher.pt"
        if not labels.is_file():
            raise SystemExit(f"--more-labels {run_dir}: no teacher.pt there (a run dir whose labels are done)")
        other = torch.load(labels)
        if other["train_x"].shape[1] != data["train_x"].shape[1]:
            raise SystemExit(
                f"--more-labels {run_dir}: windows of {other['train_x'].shape[1]} tokens, not {data['train_x'].shape[1]}"
            )
        xs.append(other["train_x"])
        hs.append(other["train_h"])
        minutes = {k: v + other[k] for k, v in minutes.items()}
        print(f"+ {len(other['train_x'])} labelled windows from {run_dir}")
    return {**data, **minutes, "train_x": torch.cat(xs), "train_h": torch.cat(hs)}


def resume_command(args) -> str:
    return f"nice -n 15 python scripts/distill_small.py --resume --run-dir {os.path.relpath(args.run_dir)}"


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """The script, with `argv` for the command line (sys.argv[1:] when None)."""
    args = parse_args(argv)
    ckpt_path = args.run_dir / "ckpt.pt"
    ckpt = torch.load(ckpt_path, weights_only=False) if args.resume and ckpt_path.is_file() else None
    if args.resume and ckpt is None and not (args.run_dir / "teacher.pt").is_file():
        raise SystemExit(f"--resume: nothing to resume in {args.run_dir}")
    if ckpt:  # the run's own options; this session's length, threads, cadence
        session = {k: getattr(args, k) for k in SESSION_OPTIONS}
        saved = {k: v for k, v in ckpt["args"].items() if k not in SESSION_OPTIONS}
        args = argparse.Namespace(**{**vars(args), **saved, **session})
        args.grow_from = pathlib.Path(args.grow_from) if args.grow_from else None
        args.out = pathlib.Path(args.out)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    t_session = time.time()
    device = pick_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    large, tokenizer = load_default_large(device, torch.float32)
    data = add_more_labels(teacher_data(large, tokenizer, args, device), args.more_labels)
    val = [(x.to(device), h.to(device).float()) for x, h in zip(data["val_x"], data["val_h"])]

    small, layers_init, init = init_student(large, args)
    params = list(small.model.layers.parameters())  # the only trainable tensors
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed + 1)
    log = {"train_kl": [], "lr": [], "heldout": [], "student_minutes": 0.0, "best_kl": float("inf")}
    start = 0
    if ckpt:
        small.load_state_dict(ckpt["layers"], strict=False)
        opt.load_state_dict(ckpt["opt"])
        g.set_state(ckpt["g"])
        torch.set_rng_state(ckpt["rng"])
        log, start = ckpt["log"], ckpt["step"]
        print(f"resumed {args.run_dir} at step {start} of {args.steps}")

    clock = {"since": time.time()}  # student minutes are summed over sessions, in the checkpoint

    def checkpoint(step: int) -> None:
        log["student_minutes"] += (time.time() - clock["since"]) / 60
        clock["since"] = time.time()
        saved_args = {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}
        state = {"step": step, "layers": own_state(small), "opt": opt.state_dict(), "g": g.get_state()}
        atomic_save({**state, "rng": torch.get_rng_state(), "log": log, "args": saved_args}, ckpt_path)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if start == 0:  # the starting point's figures: a grown student's are those of the one it grows from
        small.eval()
        log["heldout"].append({"step": 0, **heldout_kl(small, large, val)})
        small.train()
        tqdm.write(f"step 0: held-out {log['heldout'][-1]}")
    step = start
    bar = tqdm(range(start, args.steps), desc="distil", unit="step", initial=start, total=args.steps)
    try:
        for step in bar:
            rows = torch.randint(0, len(data["train_x"]), (args.batch_size,), generator=g)
            x = data["train_x"][rows].to(device)  # [B, T]
            h_l = data["train_h"][rows].to(device).float()  # [B, T, d]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            loss, kl = distill_loss(small, large, x, h_l, args, g)
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
                if log["heldout"][-1]["kl_mean"] < log["best_kl"]:
                    log["best_kl"] = log["heldout"][-1]["kl_mean"]
                    save_small(small, args.run_dir / "best", {"step": step + 1, "init": init, **log["heldout"][-1]})
                small.train()
                postfix["val_kl"] = f"{log['heldout'][-1]['kl_mean']:.3f}"
                tqdm.write(f"step {step + 1}: held-out {log['heldout'][-1]}")
            bar.set_postfix(postfix)
            if (step + 1) % args.ckpt_every == 0:
                checkpoint(step + 1)
            if args.stop_after_minutes and time.time() - t_session > 60 * args.stop_after_minutes:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        done = len(log["train_kl"])
        checkpoint(done)
        print(f"stopped at step {done}; checkpoint {ckpt_path}; resume with:\n  {resume_command(args)}")
        return
    checkpoint(args.steps)

    small.eval()
    meta = {
        "seed": args.seed,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "warmup": args.warmup,
        "hidden_weight": args.hidden_weight,
        "keep_weight": args.keep_weight,
        "keep_entropy": args.keep_entropy,
        "layers_init": layers_init,
        "init": init,
        "num_hidden_layers": len(layers_init),
        "chat_samples": args.chat_samples,
        "chat_tokens": args.chat_tokens,
        "eval_windows": args.eval_windows,
        "source_weights": data["source_weights"],
        "stream_tokens": data["stream_tokens"],
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "trainable_params": sum(p.numel() for p in params),
        "hardware": f"{device.type}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}",
        "teacher_windows": len(data["train_x"]),
        "more_labels": ",".join(os.path.relpath(d) for d in args.more_labels.split(",")) if args.more_labels else None,
        "kl_positions": args.kl_positions,
        "epochs": args.steps * args.batch_size / len(data["train_x"]),
        "chat_minutes": data["chat_minutes"],
        "teacher_minutes": data["teacher_minutes"],
        "student_minutes": log["student_minutes"],
        "wall_minutes": data["chat_minutes"] + data["teacher_minutes"] + log["student_minutes"],
        "heldout": log["heldout"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    save_small(small, args.out, {k: v for k, v in meta.items() if k != "heldout"})
    (args.out / "train_log.json").write_text(json.dumps(log) + "\n")
    plot_curves(log, args.out / "loss_curve.png")
    write_model_card(args.out, meta, reproduce_command(args))
    print(f"wrote {args.out}; last held-out {log['heldout'][-1]}")


if __name__ == "__main__":
    main()
