"""The paper's claims against what this run measured, and where this pair cannot test them.

Every row is computed from results.json; a claim whose inputs the run did not measure is left
out. A claim about staying at M_L's quality is called untestable when even the NLL oracle (the
hindsight bound on teacher-forced NLL) stays more than UNTESTABLE_OVER above M_L at that rate:
no router, however good, could show it on this pair.
"""

from __future__ import annotations

from backoff_core.evaluation.tables import table

UNTESTABLE_OVER = 0.05  # NLL over M_L's that counts as "M_L's quality" (5%)
RATE_GOAL = 0.03  # points of rate that count as "hits the calibrated rate"


def _nll_at(c: dict, router: str, rate: float) -> float:
    i = min(range(len(c["rates"])), key=lambda j: abs(c["rates"][j] - rate))
    return c["routers"][router]["curve"][i]


def _quality_claim(c: dict, claim: str, router: str, rate: float) -> list | None:
    if "nll_oracle" not in c["routers"] or router not in c["routers"]:
        return None
    over = {r: _nll_at(c, r, rate) / c["nll_large"] - 1 for r in (router, "nll_oracle")}
    measured = f"teacher-forced NLL at {rate:.0%} backoff: {router} {over[router]:+.0%}, NLL oracle {over['nll_oracle']:+.0%} over M_L"
    if over["nll_oracle"] > UNTESTABLE_OVER:
        verdict = f"cannot be tested on this pair: even the hindsight bound is {over['nll_oracle']:+.0%} over M_L"
    else:
        verdict = "holds" if over[router] <= UNTESTABLE_OVER else "does not hold"
    return [claim, measured, verdict]


def _flipped_claim(res: dict) -> list | None:
    """The paper: backing off the 0.07% highest-KL tokens hurt more than an oracle backing off
    89%. Compared on generated text where the run generated both (errors compound there, as in
    the paper's benchmarks), else teacher-forced."""
    gen = [dict(r, rule=r["label"]) for r in (res.get("generation") or {}).get("runs", []) if "KL" in r["label"]]
    rows = [dict(r, nll=r["large_nll"]) for r in gen] or res.get("oracle_table") or []
    flipped = [r for r in rows if r["rule"].startswith("flipped") or r.get("model") == "flipped-oracle"]
    oracle = [r for r in rows if r not in flipped and "KL" in r["rule"]]
    if not flipped or not oracle:
        return None
    f = min(flipped, key=lambda r: r["backoff_rate"])  # the fewest tokens backed off
    o = min(oracle, key=lambda r: abs(r["backoff_rate"] - 0.89))  # the paper's 89%
    where = "generated text, M_L NLL" if gen else "teacher-forced NLL"
    return [
        "Backing off only the few highest-KL tokens hurts more than an oracle backing off ~89%",
        f"{where}: flipped ({f['rule']}, {f['backoff_rate']:.2%} backed off) {f['nll']:.3f} vs oracle ({o['rule']}, "
        f"{o['backoff_rate']:.0%}) {o['nll']:.3f}",
        "holds" if f["nll"] > o["nll"] else "does not hold",
    ]


def _high_kl_claim(res: dict) -> list | None:
    hk = res.get("high_kl") or {}
    groups = hk.get("groups") or {}
    if len(groups) < 2:
        return None
    i = min(range(len(hk["rates"])), key=lambda j: abs(hk["rates"][j] - 0.9))
    acc = {g: v["accuracy"][i] for g, v in groups.items()}
    spread = max(acc.values()) - min(acc.values())
    objective = res["head"]["objective"]
    return [
        "Accuracy on high-KL steps falls equally in every KL group as backoff rises (binary head)",
        f"{objective} head at b={hk['rates'][i]:.2f}: " + ", ".join(f"{g} {a:.2f}" for g, a in acc.items()),
        ("holds" if spread < 0.1 else "does not hold: higher-KL groups are kept on M_L more often")
        + f" (spread {spread:.2f}; this head is trained on KL {objective}, not the paper's binary labels)"
        if objective != "binary"
        else ("holds" if spread < 0.1 else "does not hold") + f" (spread {spread:.2f})",
    ]


def _calibration_claims(res: dict) -> list[list]:
    rows = []
    fixed = [r for r in res.get("control") or [] if r["mode"] == "fixed"]
    if fixed:
        worst = max(fixed, key=lambda r: abs(r["error"]))
        rows.append(
            [
                "The threshold→rate map varies across domains (so thresholds are calibrated per benchmark)",
                f"calibrated threshold held fixed on {len({r['domain'] for r in fixed})} unseen domains: worst "
                f"{100 * worst['error']:+.1f} points ({worst['domain']}, target {worst['target']})",
                "holds" if abs(worst["error"]) > RATE_GOAL else "not seen here: the calibrated threshold transfers",
            ]
        )
    runs = [
        r for r in (res.get("generation") or {}).get("runs", []) if r["router"] == "classifier" and "@" in r["label"]
    ]
    if runs:
        worst = max(runs, key=lambda r: abs(r["backoff_rate"] - r["target"]))
        off = worst["backoff_rate"] - worst["target"]
        rows.append(
            [
                "Rates seen on a calibration split match the test split of the same benchmark",
                f"held-out generation, classifier: worst achieved − nominal {100 * off:+.1f} points (nominal "
                f"{worst['target']})",
                "holds" if abs(off) <= RATE_GOAL else "does not hold on generated text (teacher-forced calibration)",
            ]
        )
    return rows


def _speed_claim(res: dict) -> list | None:
    sp = res.get("speed")
    if not sp:
        return None
    runs = {r["label"]: r for r in sp["runs"]}
    fast = [r for k, r in runs.items() if k.startswith("classifier")]
    if "always-large" not in runs or not fast:
        return None
    best = max(fast, key=lambda r: r["backoff_rate"])
    ratio = best["tokens_per_s"] / runs["always-large"]["tokens_per_s"]
    return [
        "3–4x faster than M_L alone at high backoff (GPU, 7B-class pair)",
        f"this CPU, one stream: {ratio:.2f}x M_L alone at {best['backoff_rate']:.0%} backoff",
        "not comparable: CPU and a 135M M_L (the GPU figures are issue 11's)",
    ]


def paper_section(res: dict) -> list[str]:
    c = res["curves"]
    rows = [
        _quality_claim(c, "The classifier keeps M_L's quality up to ~50% backoff", "classifier", 0.5),
        _quality_claim(c, "The (KL) oracle backs off 70–90% of tokens with virtually no loss", "oracle", 0.8),
        _flipped_claim(res),
        _high_kl_claim(res),
        *_calibration_claims(res),
        _speed_claim(res),
    ]
    rows = [r for r in rows if r]
    if not rows:
        return []
    return [
        "## The paper's claims on this pair",
        "",
        "The paper measures task accuracy of 7B-class pairs on benchmarks; this run measures M_L's NLL of text "
        "with this pair (the default: a 135M M_L and a few-layer M_S distilled from it), offline. A quality "
        f"claim is untestable here where even the NLL oracle stays more than {UNTESTABLE_OVER:.0%} above M_L.",
        "",
        *table(["paper's claim", "measured here", "verdict"], rows),
    ]
