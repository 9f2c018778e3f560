"""The report of benchmarks/serve_overhead.py: its runs paired and summarised per point (path,
step time, streams, transport), the table it prints, the plot it saves, and the issue's
headline figures per path."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict
from pathlib import Path


def summarise(pairs: dict) -> list[dict]:
    """Per (path, step, streams, transport): median run, and the paired served / in-process ratios."""
    rows = []
    for (path, ms, n, transport), served in sorted(pairs.items()):
        ratios = sorted(s.tokens_per_s / i.tokens_per_s for s, i in served)
        ttft_extra = sorted(s.ttft_p50_s - i.ttft_p50_s for s, i in served)
        # the time one token of one stream spends in the serving path beyond its step
        extra_us = sorted(1e6 * n * (1 / s.tokens_per_s - 1 / i.tokens_per_s) for s, i in served)
        mid = sorted((s for s, _ in served), key=lambda r: r.tokens_per_s)[len(served) // 2]
        inproc = statistics.median(i.tokens_per_s for _, i in served)
        cpu_keys = {k for s, _ in served for k in s.cpu}
        rows.append(
            {
                "path": path,
                "step_ms": ms,
                "streams": n,
                "transport": transport,
                "repeats": len(served),
                "served_tokens_per_s": statistics.median(s.tokens_per_s for s, _ in served),
                "in_process_tokens_per_s": inproc,
                "ratio": statistics.median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
                "overhead_us_per_token": statistics.median(extra_us),
                "ttft_served_ms": 1e3 * statistics.median(s.ttft_p50_s for s, _ in served),
                "ttft_in_process_ms": 1e3 * statistics.median(i.ttft_p50_s for _, i in served),
                "ttft_extra_ms": 1e3 * statistics.median(ttft_extra),
                "cpu": {k: statistics.median(s.cpu.get(k, 0.0) for s, _ in served) for k in sorted(cpu_keys)},
                "median_run": asdict(mid),
            }
        )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"\n{'path':>6} {'step':>5} {'streams':>7} {'transport':>9} {'served/s':>9} {'inproc/s':>9} {'ratio':>6} "
        f"{'µs/token':>8} {'TTFT':>7} {'+TTFT':>6}  CPU (cores)"
    )
    for r in rows:
        cpu = ", ".join(
            f"{k.replace('ray::', '').replace('ServeReplica:', '')}={v:.2f}" for k, v in r["cpu"].items() if v >= 0.02
        )
        print(
            f"{r['path']:>6} {r['step_ms']:4g}ms {r['streams']:7d} {r['transport']:>9} {r['served_tokens_per_s']:9.0f} "
            f"{r['in_process_tokens_per_s']:9.0f} {r['ratio']:6.2f} {r['overhead_us_per_token']:8.0f} "
            f"{r['ttft_served_ms']:5.1f}ms {r['ttft_extra_ms']:5.1f}  {cpu}"
        )


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for path, marker in (("proxy", "o"), ("direct", "s")):
        for ms, transport in itertools.product(sorted({r["step_ms"] for r in rows}), ("http", "grpc")):
            style = marker + ("-" if transport == "http" else "--")
            rs = sorted(
                (r for r in rows if (r["path"], r["step_ms"], r["transport"]) == (path, ms, transport)),
                key=lambda r: r["streams"],
            )
            if rs:
                label = f"{path}, {ms:g} ms step, {transport}"
                a.plot([r["streams"] for r in rs], [r["ratio"] for r in rs], style, label=label)
                b.plot([r["streams"] for r in rs], [r["overhead_us_per_token"] for r in rs], style, label=label)
    a.axhline(1.0, color="grey", lw=0.5)
    for ax, title in ((a, "served / in-process tokens/s"), (b, "µs per token of a stream in the serving path")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def headline(by: dict, path: str) -> dict:
    """The issue's figures for one path: served / in-process at a 2 ms step, 1 and 16 streams,
    and the time to first token over in-process (1 stream, 2 ms)."""
    out = {}
    for transport in ("http", "grpc"):
        suffix = "" if transport == "http" else "_grpc"
        one, sixteen = by.get((path, 2.0, 1, transport), {}), by.get((path, 2.0, 16, transport), {})
        out[f"single_stream_ratio_2ms{suffix}"] = one.get("ratio")
        out[f"streams16_ratio_2ms{suffix}"] = sixteen.get("ratio")
        out[f"ttft_extra_ms_2ms{suffix}"] = one.get("ttft_extra_ms")
    return out
