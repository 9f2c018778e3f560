"""Quality and cost report of the default small model M_S against the large model M_L.

On held-out text only (files / topics / prompts that distillation never saw):
- next-token NLL of M_S and of M_L,
- the share of positions whose KL(M_L ‖ M_S) falls in 0–0.5 / 0.5–1 / 1–2 / ≥2 nats
  (the oracle decision function routes on exactly this number: the more mass below the
  threshold, the more steps can stay on M_S),
- top-1 agreement (argmax of M_S == argmax of M_L),
- per-decode-step latency of M_S and M_L (batch 1, KV cache, median over steps).

    python scripts/eval_small.py --card backoff_core/assets/small/MODEL_CARD.md

Prints a table, writes JSON, a KL histogram PNG, and (with --card) the figures into the
model card between its eval markers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

if not __package__:  # run as a script: the checkout's packages (scripts, backoff_core) importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from backoff_core.learning import corpus
from backoff_core.learning.corpus import evenly_spaced_windows, token_stream
from backoff_core.models.default_pair import STUDENT_DIR, load_default_large, load_default_small
from backoff_core.runners.dynamic import cache_keyword

KL_BUCKETS = (0.0, 0.5, 1.0, 2.0, float("inf"))  # nats; [lo, hi)
CARD_START, CARD_END = "<!-- eval:start -->", "<!-- eval:end -->"
CHAT_SOURCE = "chat"


# ---------------------------------------------------------------------------------------
# Held-out data
# ---------------------------------------------------------------------------------------


def heldout_windows(tokenizer, seq_len: int, n_per_source: int) -> dict[str, torch.Tensor]:
    """Deterministic held-out windows per corpus source: {source: [n, seq_len]}."""
    return {
        source: evenly_spaced_windows(token_stream(tokenizer, texts), seq_len, n_per_source)
        for source, texts in corpus.corpus_texts("heldout").items()
    }


@torch.inference_mode()
def chat_conversations(
    large,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    desc: str = "M_L chat",
) -> list[tuple[list[int], int]]:
    """M_L's responses to ``prompts``: (templated prompt + response token ids, prompt
    length). The response ends at (and includes) the first <|im_end|>."""
    eos = tokenizer.eos_token_id
    convs = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, unit="batch"):
        batch = [[{"role": "user", "content": p}] for p in prompts[i : i + batch_size]]
        prompt_ids = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            for m in batch
        ]
        width = max(map(len, prompt_ids))
        # Left padding keeps every prompt's last token at the same column for generate().
        input_ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        out = large.generate(
            input_ids=input_ids.to(large.device),
            attention_mask=mask.to(large.device),
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature if do_sample else None,
            top_p=None,
            top_k=None,
            pad_token_id=eos,
        )  # [b, width + new]
        for p, row in zip(prompt_ids, out[:, width:].tolist()):
            response = row[: row.index(eos) + 1] if eos in row else row
            convs.append((p + response, len(p)))
    return convs


# ---------------------------------------------------------------------------------------
# Quality
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quality:
    positions: int
    nll_small: float
    nll_large: float
    kl_mean: float
    kl_median: float
    kl_buckets: dict[str, float]  # "lo-hi" -> share of positions
    top1_agreement: float


def bucket_name(lo: float, hi: float) -> str:
    return f"{lo:g}-{hi:g}" if hi != float("inf") else f">={lo:g}"


def summarize(kl: torch.Tensor, nll_s: torch.Tensor, nll_l: torch.Tensor, agree: torch.Tensor) -> Quality:
    buckets = {
        bucket_name(lo, hi): ((kl >= lo) & (kl < hi)).float().mean().item()
        for lo, hi in zip(KL_BUCKETS[:-1], KL_BUCKETS[1:])
    }
    return Quality(
        positions=kl.numel(),
        nll_small=nll_s.mean().item(),
        nll_large=nll_l.mean().item(),
        kl_mean=kl.mean().item(),
        kl_median=kl.median().item(),
        kl_buckets=buckets,
        top1_agreement=agree.float().mean().item(),
    )


@torch.inference_mode()
def position_stats(small, large, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-position KL(M_L‖M_S), NLL_S, NLL_L, argmax agreement for x: [B, T].

    KL is measured at all T positions; NLL at the T-1 positions that have a next token.
    """
    logp_l = large(x).logits.float().log_softmax(-1)  # [B, T, V]
    logp_s = small(x).logits.float().log_softmax(-1)  # [B, T, V]
    kl = F.kl_div(logp_s, logp_l, log_target=True, reduction="none").sum(-1)  # [B, T]
    target = x[:, 1:, None]  # [B, T-1, 1]
    nll_s = -logp_s[:, :-1].gather(-1, target).squeeze(-1)  # [B, T-1]
    nll_l = -logp_l[:, :-1].gather(-1, target).squeeze(-1)
    agree = logp_s.argmax(-1) == logp_l.argmax(-1)  # [B, T]
    return kl.flatten(), nll_s.flatten(), nll_l.flatten(), agree.flatten()


Stats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # kl, nll_s, nll_l, agree


def _cat(parts: list[Stats]) -> Stats:
    return tuple(torch.cat([p[k].cpu() for p in parts]) for k in range(4))


def evaluate_windows(small, large, x: torch.Tensor, batch_size: int, desc: str) -> Stats:
    """Position stats over all windows x: [n, T]."""
    return _cat(
        [
            position_stats(small, large, x[i : i + batch_size].to(large.device))
            for i in tqdm(range(0, len(x), batch_size), desc=f"eval {desc}", unit="batch")
        ]
    )


def evaluate_chat(small, large, convs: list[tuple[list[int], int]]) -> Stats:
    """Position stats on M_L's own chat responses, response positions only: the text M_S
    has to predict while serving."""
    parts = []
    for ids, prompt_len in tqdm(convs, desc="eval chat", unit="conv"):
        kl, nll_s, nll_l, agree = position_stats(small, large, torch.tensor([ids], device=large.device))
        # Position t predicts token t+1: positions prompt_len-1 … T-2 predict the response.
        first, last = prompt_len - 1, len(ids) - 1
        parts.append((kl[first:last], nll_s[first:], nll_l[first:], agree[first:last]))
    return _cat(parts)


# ---------------------------------------------------------------------------------------
# Latency
# ---------------------------------------------------------------------------------------


@torch.inference_mode()
def decode_step_latency(model, prompt: torch.Tensor, steps: int) -> list[float]:
    """Seconds per single-token forward with KV cache after prefilling prompt: [1, P]."""
    kw = cache_keyword(model)
    out = model(prompt, use_cache=True)
    cache, token = getattr(out, kw), out.logits[:, -1:].argmax(-1)  # token: [1, 1]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, **{kw: cache}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cache = getattr(out, kw)
    return times


def measure_latency(small, large, tokenizer, steps: int, rounds: int) -> dict[str, float]:
    text = corpus.pydoc_topics_texts("heldout")[0]
    prompt = tokenizer(text, return_tensors="pt").input_ids[:, :64].to(large.device)  # [1, 64]
    times = {"small": [], "large": []}
    # Alternate the two models so that load from other processes hits both alike.
    for _ in tqdm(range(rounds), desc="latency", unit="round"):
        for name, model in (("small", small), ("large", large)):
            times[name] += decode_step_latency(model, prompt, steps)[2:]  # drop warm-up
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "small_ms": 1e3 * med["small"],
        "large_ms": 1e3 * med["large"],
        "ratio": med["large"] / med["small"],
        "steps_timed": len(times["small"]),
        "threads": torch.get_num_threads(),
        "device": str(large.device),
    }


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def format_table(results: dict[str, Quality], latency: dict | None) -> str:
    names = [bucket_name(lo, hi) for lo, hi in zip(KL_BUCKETS[:-1], KL_BUCKETS[1:])]
    lines = [
        "| held-out set | positions | NLL M_S | NLL M_L | mean KL | "
        + " | ".join(f"KL {n}" for n in names)
        + " | top-1 agree |",
        "|---" * (6 + len(names)) + "|",
    ]
    for source, q in results.items():
        lines.append(
            f"| {source} | {q.positions} | {q.nll_small:.3f} | {q.nll_large:.3f} | {q.kl_mean:.3f} | "
            + " | ".join(f"{100 * q.kl_buckets[n]:.1f}%" for n in names)
            + f" | {100 * q.top1_agreement:.1f}% |"
        )
    if latency:
        lines += [
            "",
            f"Decode step (batch 1, KV cache, median of {latency['steps_timed']} steps, "
            f"{latency['device']}, {latency['threads']} threads, fp32): "
            f"M_S {latency['small_ms']:.1f} ms, M_L {latency['large_ms']:.1f} ms, "
            f"M_L/M_S = {latency['ratio']:.2f}×",
        ]
    return "\n".join(lines)


def plot_kl_histogram(kl: torch.Tensor, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(kl.clamp(max=8).numpy(), bins=80, color="tab:blue")
    for edge in KL_BUCKETS[1:-1]:
        ax.axvline(edge, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("KL(M_L ‖ M_S) per position, nats (clipped at 8)")
    ax.set_ylabel("positions")
    ax.set_yscale("log")
    ax.set_title("Held-out KL of the default pair")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_card(card: pathlib.Path, table: str, command: str) -> None:
    text = card.read_text()
    if CARD_START not in text or CARD_END not in text:
        raise ValueError(f"{card} has no {CARD_START} … {CARD_END} section")
    head, rest = text.split(CARD_START, 1)
    _, tail = rest.split(CARD_END, 1)
    body = f"\nMeasured by `{command}`:\n\n{table}\n\n![held-out KL](kl_hist.png)\n"
    card.write_text(head + CARD_START + body + CARD_END + tail)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student-dir", type=pathlib.Path, default=STUDENT_DIR)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--windows", type=int, default=24, help="held-out windows per source")
    p.add_argument("--chat-prompts", type=int, default=24, help="held-out chat prompts (0: skip)")
    p.add_argument("--chat-tokens", type=int, default=96, help="max response tokens per prompt")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--latency-steps", type=int, default=32)
    p.add_argument("--latency-rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", type=pathlib.Path, default=None, help="default: <student-dir>/eval.json")
    p.add_argument("--card", type=pathlib.Path, default=None, help="model card to fill in")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    large, tokenizer = load_default_large(args.device, torch.float32)
    small = load_default_small(large, student_dir=args.student_dir)

    stats: dict[str, Stats] = {
        source: evaluate_windows(small, large, x, args.batch_size, source)
        for source, x in heldout_windows(tokenizer, args.seq_len, args.windows).items()
    }
    if args.chat_prompts:
        prompts = corpus.chat_prompts("heldout", "general") + corpus.chat_prompts("heldout", "python")
        step = max(1, len(prompts) // args.chat_prompts)
        convs = chat_conversations(
            large, tokenizer, prompts[::step][: args.chat_prompts], args.chat_tokens, args.batch_size
        )
        stats[CHAT_SOURCE] = evaluate_chat(small, large, convs)
    stats["all"] = _cat(list(stats.values()))
    results = {source: summarize(*s) for source, s in stats.items()}
    kl_all = stats["all"][0]
    latency = measure_latency(small, large, tokenizer, args.latency_steps, args.latency_rounds)

    table = format_table(results, latency)
    print(table)
    plot_kl_histogram(kl_all, args.student_dir / "kl_hist.png")
    report = {
        "quality": {k: asdict(v) for k, v in results.items()},
        "latency": latency,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    out = args.json or args.student_dir / "eval.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    if args.card:
        update_card(args.card, table, "python " + " ".join(sys.argv))
        print(f"updated {args.card}")


if __name__ == "__main__":
    main()
