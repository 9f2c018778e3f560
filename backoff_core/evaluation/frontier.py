"""`backoff frontier`: accuracy vs backoff rate vs tokens/s for a pair, per router and setting.

Each row (router, setting) runs the task set through the lm-eval model type `backoff`
(lm_model.py) over ONE loaded engine, then a fixed generation workload at 1 and 16 streams:
  accuracy[task]   lm-eval's acc (multiple choice) or exact_match (short answer)
  backoff_rate     share on M_S of all scored continuation positions (loglikelihood) and
                   generated tokens (generate_until)
  tok_per_s        generated tokens / wall seconds of the workload, 1 and 16 streams
M_L alone (always-large) and M_S alone (always-small) are rows of their own; `default` is
the packaged default routing (frontier_spec.DEFAULT_ROUTING) over M_L alone, both measured
in this run. A row is saved as soon as it is measured (cache_dir/<router>_<setting>.json,
with a fingerprint of what it measured), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING, TASKS, tasks_dir
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

# the speed workload: fixed prompts, a fixed number of tokens each (EOS ignored)
SPEED_PROMPTS = (
    "Q: What is the capital of France?\nA:",
    "Explain in two sentences why the sky is blue.",
    "def fibonacci(n):\n",
    "Write a short note to a friend about the weekend.",
)
SPEED_TOKENS = 24
STREAMS = (1, 16)


@dataclass(frozen=True)
class Setting:
    """One row of the frontier: a router and its threshold (None: the router decides alone)."""

    router: str
    setting: float | None = None

    @property
    def key(self) -> str:
        return self.router if self.setting is None else f"{self.router}_{self.setting:g}"

    def routing(self) -> RoutingParams:
        return RoutingParams(router=self.router, thresholds=None if self.setting is None else (self.setting,))


LARGE_ALONE = Setting("always-large")
SMALL_ALONE = Setting("always-small")


@dataclass(frozen=True)
class FrontierConfig:
    pair: str  # the chain's names joined by "+"
    tasks: tuple[str, ...] = TASKS
    include_path: str = ""  # task folder (lm-eval --include_path); "" = the packaged one
    builtin_tasks: bool = False  # also index lm-eval's own tasks (slow; most need the hub)
    limit: int | None = None  # items per task (None: all)
    batch_size: int = 64  # requests the engine steps together
    speed_tokens: int = SPEED_TOKENS
    models: str = ""  # files_digest of the models' weights: a re-distilled M_S is another config
    head: str = ""  # files_digest of the router head: another head is another config for classifier rows only

    def fingerprint(self) -> str:
        """What a cached row was measured with: a row from another config, or from other task
        files (items edited or regenerated), is not reused."""
        folder = Path(self.include_path) if self.include_path else tasks_dir()
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in {".yaml", ".jsonl", ".json", ".py"})
        digest = hashlib.sha256()
        for path in files:
            digest.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
        what = {**asdict(self), "task_files": digest.hexdigest()}
        what.pop("head")
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]

    def row_fingerprint(self, router: str) -> str:
        """A cached row's key: the configuration, and the head for a classifier row."""
        base = self.fingerprint()
        return base if router != "classifier" else hashlib.sha256(f"{base}|{self.head}".encode()).hexdigest()[:16]


_NOT_WEIGHTS = {".md", ".png", ".jpg", ".txt"}  # a model card or a plot edited later is the same model


def files_digest(paths: list[str | Path]) -> str:
    """A short digest of the files a row was measured with: each path that exists (a file, or
    every file under a folder but its docs and plots) by its content, a name that is not a
    local path as the name itself. File hashes are remembered per (path, size, mtime) beside
    the converted-GGUF cache (gguf_cache.file_sha256), so an 8B checkpoint is read once."""
    from backoff_core.models.gguf_cache import cache_root, file_sha256

    digest = hashlib.sha256()
    for entry in paths:
        root = Path(entry)
        files = (
            sorted(p for p in root.rglob("*") if p.is_file() and p.suffix not in _NOT_WEIGHTS)
            if root.is_dir()
            else [root]
        )
        for path in files:
            digest.update(str(path).encode() + b"\0")
            if path.is_file():  # else a hub id or a name: the name is all there is
                digest.update(file_sha256(path, cache_root()).encode())
    return digest.hexdigest()[:16]


def measure_speed(engine, routing: RoutingParams, streams: int, tokens: int) -> float:
    """Tokens/s of `streams` requests generated together (greedy, EOS ignored): all their
    generated tokens over the wall time, prompt prefill included."""
    requests = [
        GenerationRequest(
            tuple(engine.tokenizer.encode(SPEED_PROMPTS[i % len(SPEED_PROMPTS)])),
            SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i),
            routing,
        )
        for i in range(streams)
    ]
    start = time.perf_counter()
    results = engine.generate_many(requests)
    seconds = time.perf_counter() - start
    return sum(len(r.token_ids) for r in results) / seconds


def evaluate_row(engine, setting: Setting, config: FrontierConfig) -> dict:
    """One row: the task set through the `backoff` lm-eval model, then the speed workload."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from backoff_core.evaluation.lm_model import BackoffLM

    routing = setting.routing()
    lm = BackoffLM(engine=engine, router=routing.router, threshold=setting.setting, batch_size=config.batch_size)
    manager = TaskManager(include_path=config.include_path or str(tasks_dir()), include_defaults=config.builtin_tasks)
    results = simple_evaluate(
        model=lm,
        tasks=list(config.tasks),
        task_manager=manager,
        limit=config.limit,
        bootstrap_iters=0,
        verbosity="ERROR",
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    accuracy = {task: task_accuracy(results["results"][task]) for task in config.tasks}
    tok_per_s = {str(n): measure_speed(engine, routing, n, config.speed_tokens) for n in STREAMS}
    return {
        "router": setting.router,
        "setting": setting.setting,
        "backoff_rate": lm.usage.backoff_rate(),
        "accuracy": accuracy,
        "mean_accuracy": sum(accuracy.values()) / len(accuracy),
        "tok_per_s": tok_per_s,
    }


def task_accuracy(metrics: dict) -> float:
    """A task's accuracy: acc for multiple choice, exact_match for short answers."""
    for name in ("acc,none", "exact_match,none", "acc", "exact_match"):
        if name in metrics:
            return float(metrics[name])
    raise ValueError(f"no acc or exact_match among the task's metrics {sorted(metrics)}")


def run_frontier(
    engine,
    settings: list[Setting],
    config: FrontierConfig,
    cache_dir: Path,
    evaluate: Callable[[object, Setting, FrontierConfig], dict] = evaluate_row,
) -> dict:
    """Every setting's row (cached rows of the same fingerprint are reused), M_L alone, M_S
    alone and the packaged default; returns frontier.json's object."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    default = Setting(DEFAULT_ROUTING.router, DEFAULT_ROUTING.thresholds[0])
    todo = list(dict.fromkeys([LARGE_ALONE, SMALL_ALONE, default, *settings]))
    rows: dict[Setting, dict] = {}
    bar = tqdm(todo, desc="frontier rows", unit="row")
    for setting in bar:
        bar.set_postfix_str(setting.key)
        path = cache_dir / f"{setting.key}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("fingerprint") == config.row_fingerprint(setting.router):
                rows[setting] = saved["row"]
                continue
        start = time.perf_counter()
        row = evaluate(engine, setting, config)
        logging.getLogger(__name__).info("%s: %.0f s", setting.key, time.perf_counter() - start)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fingerprint": config.row_fingerprint(setting.router), "row": row}, indent=1))
        tmp.replace(path)  # a row is whole or absent, even if the run is killed mid-write
        rows[setting] = row
    return summarise(config, rows, default)


def remeasure_speed(engine, config: FrontierConfig, cache_dir: Path, repeats: int = 2) -> None:
    """Measure tokens/s of every cached row again, the rows interleaved (round robin,
    `repeats` times, the median kept), and save it into the cached rows. On a machine whose
    load changes over a long run, rows measured minutes apart are not comparable; measured
    side by side they are."""
    paths = {}
    for path in sorted(cache_dir.glob("*.json")):
        saved = json.loads(path.read_text())
        if saved.get("fingerprint") == config.row_fingerprint(saved["row"]["router"]):
            paths[path] = saved
    samples: dict[tuple[Path, int], list[float]] = {}
    for _ in tqdm(range(repeats), desc="speed, rows interleaved"):
        for n in STREAMS:
            for path, saved in paths.items():
                setting = Setting(saved["row"]["router"], saved["row"]["setting"])
                samples.setdefault((path, n), []).append(
                    measure_speed(engine, setting.routing(), n, config.speed_tokens)
                )
    for path, saved in paths.items():
        saved["row"]["tok_per_s"] = {str(n): statistics.median(samples[(path, n)]) for n in STREAMS}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(path)


def cached_rows(config: FrontierConfig, cache_dir: Path) -> dict:
    """frontier.json's object from every row cached under this configuration (no model is
    loaded): the report of a run stopped early, or of rows measured by several runs.
    Raises ValueError when M_L alone, M_S alone or the default is not among them."""
    rows: dict[Setting, dict] = {}
    for path in sorted(cache_dir.glob("*.json")):
        saved = json.loads(path.read_text())
        if saved.get("fingerprint") == config.row_fingerprint(saved["row"]["router"]):
            row = saved["row"]
            rows[Setting(row["router"], row["setting"])] = row
    default = Setting(DEFAULT_ROUTING.router, DEFAULT_ROUTING.thresholds[0])
    missing = [s.key for s in (LARGE_ALONE, SMALL_ALONE, default) if s not in rows]
    if missing:
        raise ValueError(f"no cached row for {', '.join(missing)} under this configuration in {cache_dir}")
    first = [LARGE_ALONE, SMALL_ALONE, default]
    ordered = {s: rows[s] for s in first} | {s: r for s, r in rows.items() if s not in first}
    return summarise(config, ordered, default)


def summarise(config: FrontierConfig, rows: dict[Setting, dict], default: Setting) -> dict:
    large, small, chosen = rows[LARGE_ALONE], rows[SMALL_ALONE], rows[default]
    return {
        "pair": config.pair,
        "tasks": list(config.tasks),
        "rows": [row for s, row in rows.items() if s not in (LARGE_ALONE, SMALL_ALONE)],
        "large_alone": large,
        "small_alone": small,
        "default": {
            "router": chosen["router"],
            "setting": chosen["setting"],
            "backoff_rate": chosen["backoff_rate"],
            "mean_accuracy": chosen["mean_accuracy"],
            "accuracy_ratio": chosen["mean_accuracy"] / large["mean_accuracy"] if large["mean_accuracy"] else None,
            "speedup_vs_large": chosen["tok_per_s"]["1"] / large["tok_per_s"]["1"],
        },
    }


def best_kept(frontier: dict, keep: float = 0.95) -> dict | None:
    """The row that keeps >= `keep` of M_L alone's mean accuracy with the highest one-stream
    tokens/s (ties: the higher backoff rate); None if no row keeps it."""
    floor = keep * frontier["large_alone"]["mean_accuracy"]
    kept = [r for r in frontier["rows"] if r["mean_accuracy"] >= floor]
    return max(kept, key=lambda r: (r["tok_per_s"]["1"], r["backoff_rate"]), default=None)


def markdown_table(frontier: dict) -> str:
    """The frontier as a Markdown table, M_L alone first, then by router and backoff rate."""
    tasks = frontier["tasks"]
    short = [t.removeprefix("backoff_") for t in tasks]
    head = ["router", "setting", "backoff rate", *short, "mean", "vs M_L", "tok/s 1", "tok/s 16"]
    large = frontier["large_alone"]
    rows = [large, frontier["small_alone"], *sorted(frontier["rows"], key=lambda r: (r["router"], r["backoff_rate"]))]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        ratio = r["mean_accuracy"] / large["mean_accuracy"] if large["mean_accuracy"] else float("nan")
        cells = [
            r["router"],
            "" if r["setting"] is None else f"{r['setting']:g}",
            f"{r['backoff_rate']:.2f}",
            *(f"{r['accuracy'][t]:.2f}" for t in tasks),
            f"{r['mean_accuracy']:.3f}",
            f"{ratio:.2f}",
            f"{r['tok_per_s']['1']:.1f}",
            f"{r['tok_per_s']['16']:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
