"""`backoff evaluate`: online rate control measured with the engine.

- control: requests that ask for a backoff rate (`target_backoff`) on domains the router
  never saw, against the same requests with the calibrated threshold held fixed; the
  requests run to max_tokens, so the controller knows their horizon;
- open horizon: chat requests that end at EOS (the controller cannot know when), the
  controller against the fixed calibrated threshold and against random routing at the
  controller's achieved rate, with the quality each costs (M_L's NLL of the sampled text,
  paired differences with 95% intervals from a bootstrap over prompts).
"""

from __future__ import annotations

import statistics
import zlib

import torch
from tqdm import tqdm

from backoff_core.engine.engine import BackoffEngine
from backoff_core.evaluation.generate import Run, ci95, per_prompt, pooled
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams


def control_runs(
    engine: BackoffEngine, domains: dict[str, list[list[int]]], head_threshold, targets, max_tokens: int, seed: int
) -> list[dict]:
    """Per domain and target: the controller (`target_backoff`) and the fixed calibrated threshold."""
    rows = []
    jobs = [(d, t, mode) for d in domains for t in targets for mode in ("controller", "fixed")]
    for domain, target, mode in tqdm(jobs, desc="rate control", unit="run"):
        prompts = domains[domain]
        run = Run(
            f"{domain}-{target}-{mode}",
            "classifier",
            target=target if mode == "controller" else None,
            thresholds=None if mode == "controller" else (head_threshold(target),),
        )
        # runs to max_tokens: the controller knows the horizon (open_horizon_runs: it does not)
        results = sampled(engine, prompts, run, max_tokens, seed, ignore_eos=True)
        rates = [r.backoff_rate for r in results]
        tokens = [len(r.token_ids) for r in results]
        pooled = sum(r * n for r, n in zip(rates, tokens)) / max(1, sum(tokens))
        rows.append(
            {
                "domain": domain,
                "target": target,
                "mode": mode,
                "pooled": pooled,
                "error": pooled - target,
                "ci95_error": rate_error_ci([r.sources.count(0) for r in results], tokens, target, f"{domain}{mode}"),
                "per_request": rates,
                "tokens": tokens,
                "mean_abs_request_error": statistics.fmean(abs(r - target) for r in rates),
                "trajectories": [_running_rate(r.sources) for r in results[:3]],
            }
        )
    return rows


def sampled(engine: BackoffEngine, prompts, run: Run, max_tokens: int, seed: int, ignore_eos: bool):
    """One sampled generation per prompt (temperature 0.8, top-p 0.95, seed + prompt index:
    every mode of a comparison draws from the same seeds)."""
    routing = RoutingParams(router=run.router, thresholds=run.thresholds, target_backoff=run.target)
    requests = [
        GenerationRequest(
            tuple(p),
            SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=seed + i, ignore_eos=ignore_eos),
            routing,
            request_id=f"{run.label}-{i}",
        )
        for i, p in enumerate(prompts)
    ]
    return engine.generate_many(requests)


def open_horizon_runs(
    engine: BackoffEngine,
    large,
    domains: dict[str, list[list[int]]],
    head_threshold,
    targets,
    max_tokens: int,
    seed: int,
) -> list[dict]:
    """Per domain and target, chat requests that end at EOS (max_tokens only caps them): the
    controller (horizon unknown), the calibrated threshold held fixed, and random routing at
    the controller's achieved rate. Quality = M_L's NLL per token of the sampled text."""
    rows = []
    jobs = [(d, t) for d in domains for t in targets]
    for domain, target in tqdm(jobs, desc="open-horizon control", unit="cell"):
        prompts = domains[domain]
        modes = {
            "controller": Run(f"{domain}-{target}-open", "classifier", target=target),
            "fixed": Run(f"{domain}-{target}-fixed", "classifier", thresholds=(head_threshold(target),)),
        }
        cell = {}
        for mode, run in modes.items():
            cell[mode] = _open_row(
                domain, target, mode, large, prompts, sampled(engine, prompts, run, max_tokens, seed, False)
            )
        rate = cell["controller"]["pooled"]
        run = Run(f"{domain}-{target}-random", "random", thresholds=(rate,))
        results = sampled(engine, prompts, run, max_tokens, seed, False)
        cell["random"] = _open_row(domain, target, "random", large, prompts, results)
        cell["controller"]["quality_cost"] = _paired_costs(cell, f"{seed}:{domain}:{target}")
        rows += cell.values()
    return rows


def _open_row(domain: str, target: float, mode: str, large, prompts, results) -> dict:
    p = per_prompt(large, prompts, results)
    q = pooled(p)
    rates = [r.backoff_rate for r in results if r.token_ids]
    return {
        "domain": domain,
        "target": target,
        "mode": mode,
        "pooled": q["backoff_rate"],
        "error": q["backoff_rate"] - target,
        "ci95_error": rate_error_ci(p["small"], p["tokens"], target, f"{domain}{mode}"),
        "per_request": rates,
        "tokens": p["tokens"],
        "ended_at_eos": sum(r.finish_reason.value == "stop" for r in results) / max(1, len(results)),
        "mean_abs_request_error": statistics.fmean(abs(r - target) for r in rates) if rates else float("nan"),
        "large_nll": q["large_nll"],
        "agreement": q["agreement"],
        "per_prompt": p,
    }


def rate_error_ci(small: list[int], tokens: list[int], target: float, key: str, n_boot: int = 1000):
    """95% interval of the pooled rate's error (small tokens / tokens − target), resampling requests."""
    n = len(tokens)
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    reps = []
    for _ in range(n_boot):
        idx = torch.randint(n, (n,), generator=g).tolist()
        total = sum(tokens[i] for i in idx)
        reps.append((sum(small[i] for i in idx) / total - target,) if total else None)
    return ci95(reps, 0)


def _paired_costs(cell: dict[str, dict], key: str, n_boot: int = 1000) -> dict:
    """The controller's M_L NLL minus the fixed threshold's and minus random's (same prompts,
    same seeds), with 95% intervals from one bootstrap over prompts for all three rows; each
    row also gets its own `ci95_nll`."""
    n = len(cell["controller"]["tokens"])
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    boots = []
    for _ in range(n_boot):
        idx = torch.randint(n, (n,), generator=g).tolist()
        boots.append({m: pooled(row["per_prompt"], idx)["large_nll"] for m, row in cell.items()})
    for m, row in cell.items():
        row["ci95_nll"] = ci95([(b[m],) for b in boots], 0)
    nll = {m: row["large_nll"] for m, row in cell.items()}
    return {
        "vs_fixed": nll["controller"] - nll["fixed"],
        "ci95_vs_fixed": ci95([(b["controller"] - b["fixed"],) for b in boots], 0),
        "vs_random": nll["controller"] - nll["random"],
        "ci95_vs_random": ci95([(b["controller"] - b["random"],) for b in boots], 0),
    }


def _running_rate(sources: tuple[int, ...]) -> list[float]:
    small, out = 0, []
    for i, s in enumerate(sources):
        small += s == 0
        out.append(small / (i + 1))
    return out
