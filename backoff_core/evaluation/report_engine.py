"""The report sections measured with the engine: generated text (and each router at matched
achieved rates), speed, rate control with the horizon known and open."""

from __future__ import annotations

from backoff_core.evaluation.tables import img as _img
from backoff_core.evaluation.tables import table as _table
from backoff_core.evaluation.tables import with_ci

CONTROL_GOAL = 0.03


def generation_section(res: dict, plots: dict) -> list[str]:
    g = res.get("generation")
    if not g:
        return []
    lines = [
        "## Generated text: M_L's NLL and greedy agreement with M_L",
        "",
        f"{g['prompts']} held-out chat prompts × {g['max_tokens']} greedy tokens. Each router generates at the "
        "thresholds its calibration set gives for a grid of rates; the text drifts from the calibration set, so "
        "the achieved rate differs from the nominal one.",
        "",
    ]
    lines += matched_table(g)
    rows = [r for r in g["runs"] if "@" in r["label"] or r["label"] in ("M_L", "M_S")]
    lines += ["Every run (nominal = the rate its threshold was calibrated for):", ""]
    lines += _table(
        ["run", "nominal", "achieved backoff %", "M_L NLL of text", "greedy agreement"],
        [[r["label"], r["target"], 100 * r["backoff_rate"], r["large_nll"], r["agreement"]] for r in rows],
    )
    return lines + _img(plots, "generation")


def matched_table(g: dict) -> list[str]:
    m = g.get("matched")
    if not m:
        return []
    rows = []
    for router, at in m["routers"].items():
        for t in m["targets"]:
            e = at.get(str(t))
            if e is None:
                rows.append([router, t, "outside the measured rates", "–", "–"])
                continue
            diff = with_ci(e["minus_random_nll"], e.get("ci95_minus_random_nll")) if "minus_random_nll" in e else "–"
            rows.append(
                [router, t, with_ci(e["large_nll"], e["ci95_nll"]), with_ci(e["agreement"], e["ci95_agreement"]), diff]
            )
    return [
        f"**At matched achieved rates** (each router's runs interpolated to the rate; 95% intervals: bootstrap "
        f"over the {m['prompts']} prompts, the same draw for every router, so the difference to random is paired):",
        "",
        *_table(
            ["router", "achieved rate", "M_L NLL of text", "greedy agreement", "NLL minus random at that rate"], rows
        ),
    ]


def matched_goal(res: dict) -> list[str]:
    m = (res.get("generation") or {}).get("matched")
    if not m or "classifier" not in m["routers"]:
        return []
    parts = []
    for t in m["targets"]:
        e = m["routers"]["classifier"].get(str(t))
        if e and "minus_random_nll" in e:
            parts.append(f"{t:g}: {with_ci(e['minus_random_nll'], e.get('ci95_minus_random_nll'))}")
    if not parts:
        return []
    return [
        f"- **Generated text at matched rates** ({m['prompts']} held-out prompts): the classifier's M_L NLL minus "
        f"random's at the same achieved rate, by rate: {'; '.join(parts)} (negative = better than random)."
    ]


def open_horizon_goal(res: dict) -> list[str]:
    rows = res.get("open_horizon")
    if not rows:
        return []
    ctrl = [r for r in rows if r["mode"] == "controller"]
    worst = max(ctrl, key=lambda r: abs(r["error"]))
    ok = abs(worst["error"]) <= CONTROL_GOAL
    costs = [r["quality_cost"] for r in ctrl]
    return [
        f"- **Open-horizon control** ({len({r['domain'] for r in ctrl})} unseen chat domains × targets "
        f"{sorted({r['target'] for r in ctrl})}; requests end at EOS, the controller is not told when): worst "
        f"pooled |achieved − target| **{abs(worst['error']) * 100:.1f} points** ({worst['domain']}, target "
        f"{worst['target']}) (goal ≤ {CONTROL_GOAL * 100:.0f}: {'met' if ok else 'MISSED'}); mean per-request "
        f"|error| {100 * sum(r['mean_abs_request_error'] for r in ctrl) / len(ctrl):.1f} points. Quality cost "
        f"(M_L NLL of the text, controller minus): fixed calibrated threshold "
        f"{_span([c['vs_fixed'] for c in costs])}, random at the controller's rate {_span([c['vs_random'] for c in costs])} "
        "over the cells (per-cell intervals below)."
    ]


def error_points(row: dict) -> str:
    """The pooled rate error in points, with its interval over requests where measured."""
    ci = row.get("ci95_error")
    return with_ci(100 * row["error"], [100 * ci[0], 100 * ci[1]] if ci else None, digits=1)


def _span(xs: list[float]) -> str:
    return f"{min(xs):+.3f} to {max(xs):+.3f}" if len(xs) > 1 else f"{xs[0]:+.3f}"


def open_horizon_section(res: dict) -> list[str]:
    rows = res.get("open_horizon")
    if not rows:
        return []
    lines = [
        "## Open-horizon control on unseen chat domains",
        "",
        "Chat requests that end at EOS (max_tokens only caps them), so the controller cannot repay a shortfall "
        "at a known last step. `controller`: `target_backoff`; `fixed`: the calibrated threshold for the target; "
        "`random`: random routing at the controller's achieved rate. Same prompts and sampling seeds in every "
        "mode; quality = M_L's NLL per token of the sampled text (95% intervals: bootstrap over requests).",
        "",
    ]
    return lines + control_table(rows, open_horizon=True)


def control_table(rows: list[dict], open_horizon: bool) -> list[str]:
    """One row per (domain, target, mode); the open-horizon table adds EOS share and quality."""
    header = ["domain", "target", "mode", "pooled achieved", "error (points)", "mean |request error| (points)"]
    header += (
        ["ended at EOS", "tokens", "M_L NLL", "controller − fixed", "controller − random"]
        if open_horizon
        else ["tokens"]
    )
    table = []
    for r in rows:
        row = [r["domain"], r["target"], r["mode"], r["pooled"], error_points(r), 100 * r["mean_abs_request_error"]]
        if not open_horizon:
            table.append([*row, sum(r["tokens"])])
            continue
        cost = r.get("quality_cost")
        table.append(
            [
                *row,
                r["ended_at_eos"],
                sum(r["tokens"]),
                with_ci(r["large_nll"], r.get("ci95_nll")),
                with_ci(cost["vs_fixed"], cost["ci95_vs_fixed"]) if cost else "",
                with_ci(cost["vs_random"], cost["ci95_vs_random"]) if cost else "",
            ]
        )
    return _table(header, table)


def speed_section(res: dict) -> list[str]:
    sp = res.get("speed")
    if not sp:
        return []
    lines = [
        "## Measured speed (this machine, shared CPU)",
        "",
        f"c_S (M_S step with hidden state) {sp['c_S_s'] * 1e3:.2f} ms; router head alone "
        f"{sp['c_head_s'] * 1e3:.3f} ms; P_L(k): "
        + ", ".join(f"k={k}: {v * 1e3:.1f} ms" for k, v in sp["P_L_s"].items()),
        "",
    ]
    lines += _table(
        ["run", "achieved backoff %", "decode tokens/s", "c_r in engine (ms)", "c_S in engine (ms)"],
        [
            [r["label"], 100 * r["backoff_rate"], r["tokens_per_s"], r["c_r_engine_s"] * 1e3, r["c_S_engine_s"] * 1e3]
            for r in sp["runs"]
        ],
    )
    return lines


def control_section(res: dict, plots: dict) -> list[str]:
    rows = res.get("control")
    if not rows:
        return []
    lines = [
        "## Online rate control on unseen domains (horizon known)",
        "",
        "`controller`: the request asks for `target_backoff`; `fixed`: the calibrated threshold for that rate "
        "held fixed (a lookup). Pooled = small tokens / all tokens over the domain's requests. The requests run "
        "to max_tokens, so the controller knows their horizon and repays any shortfall by the last step.",
        "",
    ]
    lines += control_table(rows, open_horizon=False)
    return lines + _img(plots, "control")
