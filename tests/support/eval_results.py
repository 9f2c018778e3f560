"""A small hand-made results dict in the schema `backoff evaluate` writes (evaluation/
evaluate.py: run and _engine_sections), for the report and plot tests. Numbers are chosen
so the derived ones are easy to check by hand."""

from __future__ import annotations

RATES = [0.0, 0.5, 1.0]
ROUTERS = ("random", "oracle", "classifier", "entropy", "max-prob", "flipped-oracle")
GAPS = {"random": 0.0, "oracle": 1.0, "classifier": 0.65, "entropy": 0.5, "max-prob": 0.45, "flipped-oracle": -1.0}


def _curves() -> dict:
    return {
        "rates": RATES,
        "nll_small": 4.0,
        "nll_large": 2.0,
        "positions": 100,
        "routers": {
            n: {"curve": [2.0, 3.0 - GAPS[n] / 2, 4.0], "area": 3.0 - GAPS[n] / 2, "gap_closed": GAPS[n]}
            for n in ROUTERS
        },
    }


def _speed() -> dict:
    # always-small's decision step 0.2 ms; the classifier's median 0.6 ms over c_S's median 11 ms
    runs = [
        {"label": "always-large", "tokens_per_s": 20.0, "backoff_rate": 0.0, "c_r_engine_s": 0.0, "c_S_engine_s": 0.0},
        {
            "label": "always-small",
            "tokens_per_s": 80.0,
            "backoff_rate": 1.0,
            "c_r_engine_s": 0.0002,
            "c_S_engine_s": 0.010,
        },
    ]
    runs += [
        {
            "label": f"classifier@{t}",
            "tokens_per_s": 20.0 + 60 * t,
            "backoff_rate": t,
            "c_r_engine_s": c_r,
            "c_S_engine_s": c_s,
        }
        for t, c_r, c_s in ((0.5, 0.0007, 0.012), (0.7, 0.0005, 0.010), (0.9, 0.0006, 0.011))
    ]
    return {"c_S_s": 0.010, "c_head_s": 0.0001, "P_L_s": {"1": 0.04, "4": 0.06}, "runs": runs}


def _generation() -> dict:
    runs = [
        {
            "label": "M_L",
            "router": "always-large",
            "target": None,
            "backoff_rate": 0.0,
            "large_nll": 0.7,
            "agreement": 1.0,
        },
        {
            "label": "M_S",
            "router": "always-small",
            "target": None,
            "backoff_rate": 1.0,
            "large_nll": 2.2,
            "agreement": 0.5,
        },
    ]
    runs += [
        {
            "label": f"{r}@{t}",
            "router": r,
            "target": t,
            "backoff_rate": t,
            "large_nll": 0.7 + t,
            "agreement": 1.0 - t / 2,
        }
        for r in ("oracle", "classifier", "entropy", "random")
        for t in (0.5, 0.9)
    ]
    runs.append(
        {
            "label": "oracle KL<1",
            "router": "oracle",
            "target": None,
            "backoff_rate": 0.3,
            "large_nll": 0.8,
            "agreement": 0.9,
        }
    )
    return {"prompts": 4, "max_tokens": 16, "runs": runs}


def _high_kl() -> dict:
    return {
        "rates": [0.5, 0.7, 0.9],
        "groups": {
            "KL>=1": {"count": 40, "accuracy": [0.8, 0.6, 0.3]},
            "KL>=5": {"count": 12, "accuracy": [0.9, 0.8, 0.5]},
        },
    }


def _compare() -> list[dict]:
    return [
        {
            "head": f"runs/heads/{o}-L{layer}",
            "objective": o,
            "layer": layer,
            "features": [],
            "inner_size": 64,
            "gap_closed": 0.5 + 0.05 * layer,
            "area": 3.0,
            "val_gap_closed": 0.5,
            "val_auc_high_kl": 0.8,
            "high_kl": _high_kl(),
        }
        for o in ("buckets", "regression")
        for layer in (1, 2)
    ]


def _control(errors: dict[float, float]) -> list[dict]:
    rows = []
    for domain in ("pydoc", "recipes"):
        for target, error in errors.items():
            for mode in ("controller", "fixed"):
                e = error if mode == "controller" else 2 * error
                rows.append(
                    {
                        "domain": domain,
                        "target": target,
                        "mode": mode,
                        "pooled": target + e,
                        "error": e,
                        "per_request": [target + e] * 3,
                        "tokens": [32, 32, 32],
                        "mean_abs_request_error": 0.02,
                        "trajectories": [[1.0, 0.5, target + e]] * 3,
                    }
                )
    return rows


def results(gap: float = 0.65, control_errors: dict[float, float] | None = None) -> dict:
    """Every section, as `backoff evaluate` writes them; delete keys to drop optional ones."""
    curves = _curves()
    curves["routers"]["classifier"]["gap_closed"] = gap
    domain = {n: GAPS[n] for n in ROUTERS} | {"nll_small": 4.0, "nll_large": 2.0, "positions": 50}
    return {
        "config": {"run_dir": "runs/eval"},
        "head": {
            "path": "runs/heads/buckets-L2",
            "objective": "buckets",
            "layer": 2,
            "inner_size": 64,
            "features": ["entropy", "max_prob"],
            "extra": {},
        },
        "curves": curves,
        "curves_by_domain": {"stdlib:heldout": domain},
        "curves_unseen": {"recipes": domain},
        "kl_table": {
            "stdlib:heldout": {
                "buckets": {"0-1": 0.4, "1-5": 0.5, ">=5": 0.1},
                "mean_kl": 1.5,
                "median_kl": 1.0,
                "argmax_agree": 0.4,
                "positions": 50,
            }
        },
        "oracle_table": [
            {"model": "M_S", "rule": "-", "backoff_rate": 1.0, "nll": 4.0, "top1_agree_with_large": 0.4},
            {"model": "oracle", "rule": "KL < 1", "backoff_rate": 0.4, "nll": 2.5, "top1_agree_with_large": 0.8},
        ],
        "high_kl": _high_kl(),
        "compare": _compare(),
        "generation": _generation(),
        "speed": _speed(),
        "control": _control(control_errors or {0.5: 0.01, 0.9: -0.02}),
    }


def with_intervals(res: dict) -> dict:
    """`res` as a run that also measured the NLL oracle and bootstrap intervals (ci95) writes it:
    NLL oracle 2.6 at 80% backoff against M_L's 2.0 (+30%); classifier 0.650 in 0.600–0.700."""
    c = res["curves"]
    c["windows"] = 30
    c["rates"] = [0.0, 0.8, 1.0]
    c["routers"]["nll_oracle"] = {"curve": [2.0, 2.6, 4.0], "area": 2.4, "gap_closed": 1.2}
    for r in c["routers"].values():
        r["ci95"] = [r["gap_closed"] - 0.05, r["gap_closed"] + 0.05]
    for doms in (res["curves_by_domain"], res["curves_unseen"]):
        for v in doms.values():
            v["nll_oracle"] = 1.2
            v["ci95"] = {n: [v[n] - 0.1, v[n] + 0.1] for n in (*ROUTERS, "nll_oracle")}
            v["windows"] = 12
    return res


def with_engine_intervals(res: dict) -> dict:
    """`res` as a run with matched-rate generation and open-horizon control writes it: the
    classifier 0.1 below random at 0.5 (0.05–0.15 below); on one chat domain, the controller
    lands 4 points above 0.5 and 1 below 0.9, at 0.02 / 0.05 more NLL than the fixed threshold
    and 0.1 / 0.2 less than random."""
    entry = lambda nll, d: {  # noqa: E731
        "large_nll": nll,
        "agreement": 0.8,
        "ci95_nll": [nll - 0.1, nll + 0.1],
        "ci95_agreement": [0.75, 0.85],
        **({"minus_random_nll": d, "ci95_minus_random_nll": [d - 0.05, d + 0.05]} if d is not None else {}),
    }
    res["generation"]["matched"] = {
        "prompts": 64,
        "targets": [0.5, 0.9],
        "routers": {
            "classifier": {"0.5": entry(1.2, -0.1), "0.9": None},
            "random": {"0.5": entry(1.3, None), "0.9": entry(1.8, None)},
        },
    }
    rows = []
    for target, error, cost in ((0.5, 0.04, (0.02, -0.1)), (0.9, -0.01, (0.05, -0.2))):
        for mode in ("controller", "fixed", "random"):
            row = {
                "domain": "chat-unix:train",
                "target": target,
                "mode": mode,
                "pooled": target + error,
                "error": error,
                "ci95_error": [error - 0.02, error + 0.02],
                "per_request": [target + error] * 4,
                "tokens": [40, 50, 60, 70],
                "ended_at_eos": 0.75,
                "mean_abs_request_error": 0.06,
                "large_nll": 2.0,
                "agreement": 0.7,
                "ci95_nll": [1.9, 2.1],
            }
            if mode == "controller":
                row["quality_cost"] = {
                    "vs_fixed": cost[0],
                    "ci95_vs_fixed": [cost[0] - 0.01, cost[0] + 0.01],
                    "vs_random": cost[1],
                    "ci95_vs_random": [cost[1] - 0.01, cost[1] + 0.01],
                }
            rows.append(row)
    res["open_horizon"] = rows
    return res
