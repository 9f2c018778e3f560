"""`backoff evaluate`: the paper's analyses on our pair, and the goals of the router work.

Teacher-forced, on held-out router data (no external data set needed):
  - NLL of the routed mixture vs backoff rate for oracle / classifier / entropy / max-prob /
    random (the paper's Figure 2), the NLL oracle (the true bound), and the share of the
    random→oracle gap each closes with a 95% interval from a bootstrap over windows;
  - KL bucket table per domain (Table 1); oracle vs flipped oracle at KL thresholds (Table 2);
  - the head's accuracy on high-KL positions vs backoff rate (Figure 3);
  - every compared head (objective × layer): held-out gap closed (Figure 4: quality per layer).
With the engine (evaluation.generate / evaluation.control): generation quality on a fixed
prompt set, each router interpolated to the same achieved rates; measured speed; online rate
control on domains the router never saw, with the horizon known (requests run to max_tokens)
and open (chat requests end at EOS). Intervals are bootstrap 95% intervals over documents
(teacher-forced) or prompts (generation). Everything lands in run_dir/results.json,
run_dir/report.md and run_dir/*.png.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from backoff_core.evaluation import control as ctl
from backoff_core.evaluation import generate as gen
from backoff_core.learning import data as router_data
from backoff_core.learning.calibrate import head_scores
from backoff_core.learning.data import RouterData
from backoff_core.learning.metrics import (
    RATES,
    area,
    bootstrap_ci,
    gap_closed,
    gap_closed_all,
    nll_curve,
    nll_oracle_score,
    random_curve,
    thresholds_for_rates,
)
from backoff_core.models.kernels import model_fingerprint
from backoff_core.routing.head import ClassifierHead

KL_BUCKETS = (0.0, 0.5, 1.0, 2.0, 5.0, float("inf"))  # the paper's Table 1 edges, plus >= 5
TABLE2_THRESHOLDS = (1.0, 2.0, 5.0, 10.0)
FLIPPED_THRESHOLDS = (5.0, 10.0)
HIGH_KL_GROUPS = (1.0, 2.0, 5.0)
SECTIONS = ("layers", "generation", "speed", "control", "open_horizon")
RATE_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # calibrated rates each router generates at


@dataclass(frozen=True)
class EvalConfig:
    run_dir: Path
    head: str
    heldout: tuple[str, ...]
    calib: tuple[str, ...] = ()
    compare: tuple[str, ...] = ()  # more heads (objectives × layers) scored on the held-out data
    unseen: tuple[str, ...] = ()
    prompts: int = 64
    max_tokens: int = 48
    control_requests: int = 6
    control_tokens: int = 128
    open_requests: int = 32  # chat requests per unseen chat domain and target, ending at EOS
    open_tokens: int = 192  # their cap
    rate_grid: tuple[float, ...] = RATE_GRID  # with `targets`: the calibrated rates generation runs at
    grid_routers: tuple[str, ...] = ("oracle", "classifier", "entropy", "random")
    targets: tuple[float, ...] = (0.5, 0.7, 0.9)
    skip: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = set(self.skip) - set(SECTIONS)
        if unknown:
            raise ValueError(f"unknown section(s) to skip {sorted(unknown)}; choose from {SECTIONS}")


def router_scores(head: ClassifierHead, data: RouterData) -> dict[str, torch.Tensor]:
    """Score per position of every decision function (higher = send to M_L)."""
    return {
        "oracle": data.kl,
        "classifier": head_scores(head, data),
        "entropy": data.ent_s,
        "max-prob": 1.0 - data.maxp_s,
    }


def curves(head: ClassifierHead, data: RouterData, n_boot: int = 1000, seed: int = 0) -> dict:
    """NLL(b) per router, each router's area and gap closed (Figure 2, teacher-forced), and a
    95% interval of each gap closed from a bootstrap over documents (n_boot resamples; all the
    windows of a document are drawn together)."""
    out = {
        "rates": RATES.tolist(),
        "nll_small": float(data.nll_s.mean()),
        "nll_large": float(data.nll_l.mean()),
        "positions": len(data),
        "windows": len(torch.unique(data.window)),
        "documents": len(torch.unique(data.doc)),
        "routers": {},
    }
    rand = random_curve(data.nll_s, data.nll_l)
    out["routers"]["random"] = {"curve": rand.tolist(), "area": area(rand), "gap_closed": 0.0, "ci95": [0.0, 0.0]}
    # the NLL oracle is the true lower bound on NLL(b); the KL oracle stays the gap's reference
    scores = router_scores(head, data) | {
        "nll_oracle": nll_oracle_score(data.nll_s, data.nll_l),
        "flipped-oracle": -data.kl,
    }
    gaps = gap_closed_all(scores, data.kl, data.nll_s, data.nll_l)
    names = list(scores)
    ci = bootstrap_ci(
        lambda kl, nll_s, nll_l, *s: gap_closed_all(dict(zip(names, s)), kl, nll_s, nll_l),
        (data.kl, data.nll_s, data.nll_l, *scores.values()),
        data.doc,
        n_boot=n_boot,
        seed=seed,
    )
    for i, (name, s) in enumerate(scores.items()):
        c = nll_curve(s, data.nll_s, data.nll_l)
        out["routers"][name] = {
            "curve": c.tolist(),
            "area": area(c),
            "gap_closed": float(gaps[i]),
            "ci95": ci[i].tolist(),
        }
    return out


def per_domain(data: RouterData, fn) -> dict[str, object]:
    return {
        name: fn(data.subset(data.domain == i)) for i, name in enumerate(data.domains) if bool((data.domain == i).any())
    }


def kl_table(data: RouterData) -> dict:
    """Share of positions per KL bucket (Table 1), with mean KL and agreement."""
    kl = data.kl
    buckets = {}
    for lo, hi in zip(KL_BUCKETS[:-1], KL_BUCKETS[1:]):
        buckets[f"{lo:g}-{hi:g}" if hi != float("inf") else f">={lo:g}"] = float(
            ((kl >= lo) & (kl < hi)).float().mean()
        )
    return {
        "buckets": buckets,
        "mean_kl": float(kl.mean()),
        "median_kl": float(kl.median()),
        "argmax_agree": float(data.agree.float().mean()),
        "positions": len(kl),
    }


def oracle_table(data: RouterData) -> list[dict]:
    """Oracle (KL < T stays small) vs flipped oracle (KL >= T stays small): Table 2, teacher-forced."""
    rows = [
        _routed(data, torch.ones(len(data), dtype=torch.bool), "M_S", "-"),
        _routed(data, torch.zeros(len(data), dtype=torch.bool), "M_L", "-"),
    ]
    rows += [_routed(data, data.kl < t, "oracle", f"KL < {t:g}") for t in TABLE2_THRESHOLDS]
    rows += [_routed(data, data.kl >= t, "flipped-oracle", f"KL >= {t:g}") for t in FLIPPED_THRESHOLDS]
    return rows


def _routed(data: RouterData, small: torch.Tensor, model: str, rule: str) -> dict:
    nll = torch.where(small, data.nll_s, data.nll_l)
    agree = torch.where(small, data.agree.bool(), torch.ones_like(small))
    return {
        "model": model,
        "rule": rule,
        "backoff_rate": float(small.float().mean()),
        "nll": float(nll.mean()),
        "top1_agree_with_large": float(agree.float().mean()),
    }


def high_kl_accuracy(scores: torch.Tensor, kl: torch.Tensor) -> dict:
    """Share of positions with KL >= g that go to M_L, at each backoff rate (Figure 3)."""
    rates = [round(float(r), 2) for r in torch.linspace(0.0, 0.95, 20)]
    thresholds = thresholds_for_rates(scores, rates)
    out = {"rates": rates, "groups": {}}
    for g in HIGH_KL_GROUPS:
        group = kl >= g
        if int(group.sum()) < 10:
            continue
        s = scores[group]
        out["groups"][f"KL>={g:g}"] = {
            "count": int(group.sum()),
            "accuracy": [float((s >= t).float().mean()) for t in thresholds],
        }
    return out


def compare_heads(heads: dict[str, ClassifierHead], data: RouterData) -> list[dict]:
    rand = area(random_curve(data.nll_s, data.nll_l))
    oracle = area(nll_curve(data.kl, data.nll_s, data.nll_l))
    rows = []
    for path, head in heads.items():
        s = head_scores(head, data)
        a = area(nll_curve(s, data.nll_s, data.nll_l))
        val = head.meta.extra.get("val") or {}
        rows.append(
            {
                "head": path,
                "objective": head.meta.objective,
                "layer": head.layer,
                "features": list(head.meta.features),
                "inner_size": head.meta.inner_size,
                "gap_closed": gap_closed(a, rand, oracle),
                "area": a,
                "val_gap_closed": val.get("gap_closed"),
                "val_auc_high_kl": val.get("auc_high_kl"),
                "high_kl": high_kl_accuracy(s, data.kl),
            }
        )
    return rows


def fixed_thresholds(head: ClassifierHead, calib: RouterData | None, targets) -> dict[str, dict[float, float]]:
    """Per router and target rate, the threshold that gives that rate on the calibration set."""
    out = {"random": {t: t for t in targets}}
    out["classifier"] = {t: head.threshold_for_rate(t) for t in targets}
    if calib is not None:
        for name, s in (("oracle", calib.kl), ("entropy", calib.ent_s)):
            out[name] = dict(zip(targets, thresholds_for_rates(s, targets)))
    return out


def run(cfg: EvalConfig, chain) -> Path:
    from backoff_core.evaluation.plots import plot_all
    from backoff_core.evaluation.report import write_report

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    head = ClassifierHead.load(cfg.head)
    heldout = router_data.load(list(cfg.heldout))
    _check_pair(head, heldout, chain)
    res: dict = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in cfg.__dict__.items()},
        "head": {
            "path": cfg.head,
            "objective": head.meta.objective,
            "layer": head.layer,
            "inner_size": head.meta.inner_size,
            "features": list(head.meta.features),
            "extra": head.meta.extra,
        },
    }
    res["curves"] = curves(head, heldout, seed=cfg.seed)
    res["curves_by_domain"] = per_domain(heldout, lambda d: _gaps(curves(head, d, seed=cfg.seed)))
    unseen = router_data.load(list(cfg.unseen)) if cfg.unseen else None
    if unseen is not None:
        res["curves_unseen"] = per_domain(unseen, lambda d: _gaps(curves(head, d, seed=cfg.seed)))
    res["kl_table"] = per_domain(heldout, kl_table) | (per_domain(unseen, kl_table) if unseen else {})
    res["oracle_table"] = oracle_table(heldout)
    res["high_kl"] = high_kl_accuracy(head_scores(head, heldout), heldout.kl)
    heads = {cfg.head: head} | {p: ClassifierHead.load(p) for p in cfg.compare if p != cfg.head}
    res["compare"] = compare_heads(heads, heldout) if "layers" not in cfg.skip else []
    calib = router_data.load(list(cfg.calib)) if cfg.calib else None
    _engine_sections(cfg, chain, head, heldout, calib, res)
    (run_dir / "results.json").write_text(json.dumps(res, indent=1, default=_json_default))
    plots = plot_all(res, run_dir)
    return write_report(res, plots, run_dir)


def _engine_sections(cfg: EvalConfig, chain, head, heldout, calib, res: dict) -> None:
    from backoff_core.engine.engine import BackoffEngine

    engine = BackoffEngine.from_chain(chain, classifier_path=cfg.head)
    large = chain.models[-1]
    if "generation" not in cfg.skip:
        prompts = gen.chat_prompt_ids(chain.tokenizer, Path(cfg.heldout[-1]), cfg.prompts, cfg.seed)
        if not prompts:
            raise ValueError(f"{cfg.heldout[-1]} holds no chat records to take generation prompts from")
        grid = sorted(set(cfg.rate_grid) | set(cfg.targets))
        th = fixed_thresholds(head, calib, grid)
        runs = [gen.Run("M_L", "always-large"), gen.Run("M_S", "always-small")]
        runs += [
            gen.Run(f"{r}@{t}", r, thresholds=(th[r][t],), nominal=t) for r in cfg.grid_routers if r in th for t in grid
        ]
        if "oracle" in cfg.grid_routers:  # the oracle's runs (M_L every step) are the dear ones
            runs += [gen.Run(f"oracle KL<{t:g}", "oracle", thresholds=(t,)) for t in TABLE2_THRESHOLDS]
            runs += [gen.Run(f"flipped KL>={t:g}", "flipped-oracle", thresholds=(-t,)) for t in FLIPPED_THRESHOLDS]
        rows = gen.quality_runs(engine, large, prompts, runs, cfg.max_tokens)
        res["generation"] = {
            "prompts": len(prompts),
            "max_tokens": cfg.max_tokens,
            "runs": rows,
            "matched": gen.matched(rows, cfg.targets, seed=cfg.seed),
        }
    if "speed" not in cfg.skip:
        prompt = gen.chat_prompt_ids(chain.tokenizer, Path(cfg.heldout[-1]), 1, cfg.seed + 1)[0]
        res["speed"] = gen.speed(chain, engine, head, prompt, (0.5, 0.7, 0.9), cfg.max_tokens)
    if "control" not in cfg.skip and cfg.unseen:
        domains = {}
        for d in cfg.unseen:
            manifest = json.loads((Path(d) / "manifest.json").read_text())
            domains[manifest["config"]["corpora"][0]] = gen.domain_prompt_ids(
                chain.tokenizer, Path(d), cfg.control_requests, cfg.seed
            )
        res["control"] = ctl.control_runs(
            engine, domains, head.threshold_for_rate, cfg.targets, cfg.control_tokens, cfg.seed
        )
    chats = [d for d in cfg.unseen if gen.chat_files(Path(d))]
    if "open_horizon" not in cfg.skip and chats:
        domains = {
            json.loads((Path(d) / "manifest.json").read_text())["config"]["corpora"][0]: gen.chat_prompt_ids(
                chain.tokenizer, Path(d), cfg.open_requests, cfg.seed
            )
            for d in chats
        }
        res["open_horizon"] = ctl.open_horizon_runs(
            engine, large, domains, head.threshold_for_rate, cfg.targets, cfg.open_tokens, cfg.seed
        )


def _gaps(c: dict) -> dict:
    return {name: r["gap_closed"] for name, r in c["routers"].items()} | {
        "ci95": {name: r["ci95"] for name, r in c["routers"].items()},
        "nll_small": c["nll_small"],
        "nll_large": c["nll_large"],
        "positions": c["positions"],
        "windows": c["windows"],
        "documents": c["documents"],
    }


def _check_pair(head: ClassifierHead, data: RouterData, chain) -> None:
    want = head.meta.extra.get("small_fingerprint")
    got = data.pair.get("small_fingerprint")
    if want and got and want != got:
        raise ValueError("the head was trained on router data of another M_S than the evaluation data")
    if got and got != model_fingerprint(chain.models[0]):
        raise ValueError(f"the evaluation data was made with another M_S than the loaded {chain.names[0]}")


def _json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def rewrite(run_dir: str | Path) -> Path:
    """Plots and report again from run_dir/results.json (no model is run). PNGs of an earlier
    run that this results.json no longer draws are removed, so none is left stale."""
    from backoff_core.evaluation.plots import PLOTS, plot_all
    from backoff_core.evaluation.report import write_report

    run_dir = Path(run_dir)
    res = json.loads((run_dir / "results.json").read_text())
    plots = plot_all(res, run_dir)
    for name in set(PLOTS) - set(plots):
        (run_dir / f"{name}.png").unlink(missing_ok=True)
    return write_report(res, plots, run_dir)


# each engine section and the results.json key it writes
SECTION_KEYS = {s: s for s in SECTIONS} | {"layers": "compare"}


def merge(parts: list[str | Path], run_dir: str | Path) -> Path:
    """One run from evaluate runs that each skipped some engine sections (run side by side on
    a machine with cores to spare): each section comes from the first part that ran it. The
    teacher-forced results must be the same in every part (same data, head, seed), else it
    refuses. Writes run_dir/results.json (config.parts: each part's config), plots, report."""
    runs = [json.loads((Path(d) / "results.json").read_text()) for d in parts]
    base = runs[0]
    for d, r in zip(parts[1:], runs[1:]):
        if r["curves"] != base["curves"] or r["head"] != base["head"]:
            raise ValueError(f"{d} holds another evaluation than {parts[0]} (curves or head differ)")
    out = dict(base)
    for section, key in SECTION_KEYS.items():
        ran = [r for r in runs if section not in r["config"].get("skip", ())]
        out.pop(key, None)
        if ran and key in ran[0]:
            out[key] = ran[0][key]
    out["config"] = dict(base["config"], skip=sorted(set.intersection(*(set(r["config"]["skip"]) for r in runs))))
    out["config"]["parts"] = [r["config"] for r in runs]
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "results.json").write_text(json.dumps(out, indent=1, default=_json_default))
    return rewrite(run_dir)
