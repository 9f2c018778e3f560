"""results.json -> report.md: the goals first, then the paper's tables and figures."""

from __future__ import annotations

import re
from pathlib import Path

from backoff_core.evaluation.claims import paper_section
from backoff_core.evaluation.report_engine import (
    CONTROL_GOAL,
    control_section,
    generation_section,
    matched_goal,
    open_horizon_goal,
    open_horizon_section,
    speed_section,
)
from backoff_core.evaluation.tables import img as _img
from backoff_core.evaluation.tables import table as _table
from backoff_core.evaluation.tables import with_ci as _with_ci

GAP_GOAL = 0.60
HEAD_COST_GOAL = 0.05
DISTILLED = frozenset({"stdlib", "docstrings", "pydoc", "chat-general", "chat-python"})  # M_S's distillation corpora


def goals(res: dict) -> list[str]:
    lines = ["## Goals", ""]
    gap = res["curves"]["routers"]["classifier"]["gap_closed"]
    h = res["head"]
    lines.append(
        f"- **Gap closed** (area under NLL vs backoff, random → oracle, held-out text): "
        f"**{gap:.3f}**{_ci(res['curves'], 'classifier')} with the {h['objective']} head on layer {h['layer']} "
        f"(goal ≥ {GAP_GOAL:.2f}: {'met' if gap >= GAP_GOAL else 'MISSED'})."
    )
    lines += _gap_goal_table(res)
    ctrl = [r for r in res.get("control", []) if r["mode"] == "controller"]
    if ctrl:
        worst = max(ctrl, key=lambda r: abs(r["error"]))
        ok = abs(worst["error"]) <= CONTROL_GOAL
        lines.append(
            f"- **Online control** on {len({r['domain'] for r in ctrl})} unseen domains × targets "
            f"{sorted({r['target'] for r in ctrl})}: worst |achieved − target| (pooled per domain) "
            f"**{abs(worst['error']) * 100:.1f} points** ({worst['domain']}, target {worst['target']}) "
            f"(goal ≤ {CONTROL_GOAL * 100:.0f}: {'met' if ok else 'MISSED'}); mean per-request |error| "
            f"{100 * sum(r['mean_abs_request_error'] for r in ctrl) / len(ctrl):.1f} points."
            + (
                " The requests run to max_tokens, so the controller knows their horizon."
                if "open_horizon" in res
                else ""
            )
        )
    lines += open_horizon_goal(res) + matched_goal(res)
    sp = res.get("speed")
    if sp:
        cost = head_cost(sp)
        what = "MLP" + (
            " + " + "/".join(h.get("features") or ()) + " from the step's logits" if h.get("features") else ""
        )
        lines.append(
            f"- **Router head cost** ({what}), measured in the engine as the decision step's time with the "
            f"head minus without it (always-small): **{cost['marginal_s'] * 1e3:.3f} ms = "
            f"{100 * cost['marginal_ratio']:.1f}%** of the M_S step ({cost['c_S_s'] * 1e3:.2f} ms) "
            f"(goal ≤ {HEAD_COST_GOAL * 100:.0f}%: {'met' if cost['marginal_ratio'] <= HEAD_COST_GOAL else 'MISSED'}); "
            f"the head alone with warm caches: {sp['c_head_s'] * 1e3:.3f} ms "
            f"({100 * sp['c_head_s'] / sp['c_S_s']:.1f}% of c_S measured alone, {sp['c_S_s'] * 1e3:.2f} ms)."
        )
    return lines + [""]


def distilled(domain: str) -> str:
    """Whether M_S's distillation read this domain: 'yes' / 'no' for a built-in spec (its train
    and calibration splits are distillation text), '–' for a user's path."""
    m = re.search(r"(?:^|/)([a-z-]+):(train|calib|heldout)$", domain)
    if not m:
        return "–"
    return "yes" if m.group(1) in DISTILLED and m.group(2) != "heldout" else "no"


def _gap_goal_table(res: dict) -> list[str]:
    """The gap goal per held-out domain and per unseen domain, with intervals, where measured."""
    rows = []
    for kind, key in (("held out", "curves_by_domain"), ("unseen", "curves_unseen")):
        for d, v in (res.get(key) or {}).items():
            ci = v.get("ci95", {})
            verdict = "met" if v["classifier"] >= GAP_GOAL else "MISSED"
            if ci.get("classifier") and ci["classifier"][0] < GAP_GOAL <= ci["classifier"][1]:
                verdict += " (interval spans the goal)"
            rows.append(
                [
                    d,
                    kind,
                    distilled(d),
                    v.get("documents", v.get("windows", "–")),
                    v["positions"],
                    _with_ci(v["classifier"], ci.get("classifier")),
                    _with_ci(v["entropy"], ci.get("entropy")) if "entropy" in v else "–",
                    verdict,
                ]
            )
    if not rows:
        return []
    return [
        "",
        f'  Per domain (95% intervals: bootstrap over documents; goal ≥ {GAP_GOAL:.2f}; "M_S distilled on it": '
        "the small model's distillation read this domain's training split: it is new to the router alone):",
        "",
        *_table(
            ["domain", "split", "M_S distilled on it", "documents", "positions", "classifier", "entropy", "goal"], rows
        ),
    ]


def _ci(c: dict, router: str) -> str:
    """' (95% CI lo–hi, bootstrap over N documents)' where results.json holds the interval
    (runs before documents were stored resampled windows)."""
    ci = c["routers"][router].get("ci95")
    return f" (95% CI {ci[0]:.3f}–{ci[1]:.3f}, bootstrap over {_unit(c)})" if ci else ""


def _unit(c: dict) -> str:
    return f"{c['documents']} documents" if "documents" in c else f"{c['windows']} windows"


def nll_oracle_at(c: dict, rate: float = 0.8) -> dict | None:
    """NLL of the NLL oracle (and the KL oracle) at the curve's rate nearest `rate`, and how far
    the NLL oracle stays above M_L alone: what no router can beat on this pair."""
    if "nll_oracle" not in c["routers"]:
        return None
    i = min(range(len(c["rates"])), key=lambda j: abs(c["rates"][j] - rate))
    best = c["routers"]["nll_oracle"]["curve"][i]
    return {
        "rate": c["rates"][i],
        "nll_oracle": best,
        "kl_oracle": c["routers"]["oracle"]["curve"][i],
        "over_large": best / c["nll_large"] - 1,
    }


def _nll_oracle_line(c: dict) -> list[str]:
    at = nll_oracle_at(c)
    if at is None:
        return []
    return [
        f"At {100 * at['rate']:.0f}% backoff even the NLL oracle reaches NLL {at['nll_oracle']:.3f} "
        f"(KL oracle {at['kl_oracle']:.3f}, M_L alone {c['nll_large']:.3f}): "
        f"**{100 * at['over_large']:+.0f}% NLL over M_L**"
        + (", so no router on this pair can match M_L there." if at["over_large"] > 0 else "."),
        "",
    ]


def head_cost(sp: dict) -> dict:
    """In-engine cost of the head: median decision-step time of the classifier runs minus that
    of always-small (which pays the same step bookkeeping but no head), over the engine's c_S."""
    rows = {r["label"]: r for r in sp["runs"]}
    clf = sorted(r["c_r_engine_s"] for k, r in rows.items() if k.startswith("classifier"))
    base = rows["always-small"]["c_r_engine_s"]
    c_s = sorted(r["c_S_engine_s"] for k, r in rows.items() if k.startswith("classifier"))
    marginal = clf[len(clf) // 2] - base
    c_s_med = c_s[len(c_s) // 2]
    return {"marginal_s": marginal, "c_S_s": c_s_med, "marginal_ratio": marginal / c_s_med}


def curves_section(res: dict, plots: dict) -> list[str]:
    c = res["curves"]
    lines = [
        "## Quality vs backoff rate (paper Figure 2, teacher-forced)",
        "",
        f"Held-out positions: {c['positions']}; NLL M_S alone {c['nll_small']:.3f}, M_L alone {c['nll_large']:.3f}.",
        "",
    ]
    names = list(c["routers"])
    if "nll_oracle" in c["routers"]:
        lines += [
            "`nll_oracle` sends to M_L the positions where M_L's NLL of the actual next token gains most "
            "(known only in hindsight): the true upper bound on teacher-forced quality at every backoff rate. "
            "The KL `oracle` is not; gap closed stays measured random → KL oracle, so the NLL oracle's exceeds 1.",
            "",
            *_nll_oracle_line(c),
        ]
    cis = [c["routers"][n].get("ci95") for n in names]
    lines += _table(
        ["router", "area under NLL(b)", "gap closed"] + ([f"95% CI ({_unit(c)})"] if any(cis) else []),
        [
            [n, c["routers"][n]["area"], c["routers"][n]["gap_closed"]]
            + ([f"{ci[0]:.3f}–{ci[1]:.3f}" if ci else "–"] if any(cis) else [])
            for n, ci in zip(names, cis)
        ],
    )
    for key, title in (
        ("curves_by_domain", "Gap closed per held-out domain"),
        ("curves_unseen", "Gap closed on domains the router never saw"),
    ):
        if res.get(key):
            doms = res[key]
            first = next(iter(doms.values()))
            routers = [n for n in ("classifier", "entropy", "max-prob", "oracle", "nll_oracle") if n in first]
            unit = "documents" if "documents" in first else "windows"
            note = f" (95% CI: bootstrap over the domain's {unit})" if "ci95" in first else ""
            lines += [f"**{title}**{note}", ""]
            lines += _table(
                ["domain", "M_S distilled on it", "positions", "NLL M_S", "NLL M_L", *routers],
                [
                    [
                        d,
                        distilled(d),
                        v["positions"],
                        v["nll_small"],
                        v["nll_large"],
                        *[_with_ci(v[r], v.get("ci95", {}).get(r)) for r in routers],
                    ]
                    for d, v in doms.items()
                ],
            )
    lines += _img(plots, "quality_vs_backoff") + _img(plots, "quality_vs_speed")
    return lines


def kl_section(res: dict) -> list[str]:
    lines = ["## KL(M_L ‖ M_S) buckets (paper Table 1)", ""]
    doms = res["kl_table"]
    buckets = list(next(iter(doms.values()))["buckets"])
    lines += _table(
        ["domain", "positions", *buckets, "mean KL", "argmax agree"],
        [
            [d, v["positions"], *[v["buckets"][b] for b in buckets], v["mean_kl"], v["argmax_agree"]]
            for d, v in doms.items()
        ],
    )
    return lines


def oracle_section(res: dict) -> list[str]:
    lines = [
        "## Oracle vs flipped oracle (paper Table 2)",
        "",
        "Teacher-forced on held-out text (NLL of the text; share of positions whose routed model's argmax "
        "equals M_L's):",
        "",
    ]
    lines += _table(
        ["model", "rule (stays on M_S)", "backoff %", "NLL", "top-1 = M_L"],
        [
            [r["model"], r["rule"], 100 * r["backoff_rate"], r["nll"], r["top1_agree_with_large"]]
            for r in res["oracle_table"]
        ],
    )
    lines += _nll_oracle_line(res["curves"])
    g = res.get("generation")
    if g:
        rows = [r for r in g["runs"] if r["label"] in ("M_L", "M_S") or "KL" in r["label"]]
        lines += [f"Generated ({g['prompts']} held-out chat prompts × {g['max_tokens']} greedy tokens):", ""]
        lines += _table(
            ["run", "backoff %", "M_L NLL of text", "greedy agreement with M_L"],
            [[r["label"], 100 * r["backoff_rate"], r["large_nll"], r["agreement"]] for r in rows],
        )
    return lines


def high_kl_section(res: dict, plots: dict) -> list[str]:
    hk = res["high_kl"]
    want = [0.5, 0.7, 0.9]
    idx = [min(range(len(hk["rates"])), key=lambda i: abs(hk["rates"][i] - w)) for w in want]
    lines = [
        "## Accuracy on high-KL positions vs backoff rate (paper Figure 3)",
        "",
        "Share of positions in each KL group that the head sends to M_L:",
        "",
    ]
    lines += _table(
        ["group", "count", *[f"b={hk['rates'][i]:.2f}" for i in idx]],
        [[g, v["count"], *[v["accuracy"][i] for i in idx]] for g, v in hk["groups"].items()],
    )
    return lines + _img(plots, "high_kl_accuracy")


def compare_section(res: dict, plots: dict) -> list[str]:
    rows = res.get("compare", [])
    if not rows:
        return []
    lines = ["## Heads by objective and layer (paper Figure 4: quality per layer depth)", ""]
    lines += _table(
        ["head", "objective", "layer", "logit features", "inner", "held-out gap closed", "val gap closed", "val AUC"],
        [
            [
                Path(r["head"]).name,
                r["objective"],
                r["layer"],
                ",".join(r.get("features", [])) or "–",
                r["inner_size"],
                r["gap_closed"],
                r["val_gap_closed"],
                r["val_auc_high_kl"],
            ]
            for r in sorted(rows, key=lambda r: (r["objective"], r["layer"]))
        ],
    )
    return lines + _img(plots, "layers")


def write_report(res: dict, plots: dict, run_dir: Path) -> Path:
    h = res["head"]
    lines = [
        "# Backoff decoding: learned decision functions on our pair",
        "",
        f"Head `{h['path']}`: {h['objective']} objective, M_S layer {h['layer']}"
        f"{' + ' + ', '.join(h['features']) if h.get('features') else ''}, inner size {h['inner_size']}. "
        "All numbers below are measured by `backoff evaluate` (results.json beside this file).",
        "",
    ]
    lines += goals(res)
    for part in (
        paper_section(res),
        curves_section(res, plots),
        kl_section(res),
        oracle_section(res),
        generation_section(res, plots),
        high_kl_section(res, plots),
        compare_section(res, plots),
        speed_section(res),
        control_section(res, plots),
        open_horizon_section(res),
    ):
        lines += part
    path = Path(run_dir) / "report.md"
    path.write_text("\n".join(lines))
    return path
