"""The benchmark pair on the GPU at gpu_bench.sh's defaults, checked against the plan.

    python benchmarks/gpu_check.py --small /tmp/pair/small --large /tmp/pair/large --out DIR

Loads the pair (bf16), builds each runner as the engine does (factory.make_runner: static
KV slots, graphs captured now) and measures what benchmarks/gpu_plan.py predicts: graphs,
capture seconds, KV bytes and the memory the capture added (pool + static buffers). Then
checks the real shapes: M_L's logits after a prompt catch-up (in blocks) against HF's own bf16
forward, and a few generations per routing with no forward run eagerly. Last, where the
time of one step goes: a captured step's GPU time alone (CUDA events around the replay) and
its kernel count, against the whole runner.extend (plan, upload, replay, float copy), for
M_S as the factory builds it (fused projections and norms), without the fused projections,
and with HF's own modules throughout, and for M_L. Also saves every graph's replay time as
warmup measured it (`replay_ms`: what static_layout.choose weighs, and the cost table of
benchmarks/gpu_sim.py). And what the engine's graphs do not hold but gpu_sim prices
(`probes`): M_S's replays at k 4, 8 and 16 (a prompt's prefill in fewer rows), and each model's
prompt prefill run eagerly against the same prefill in graphs (what a forward no graph holds
costs). And how M_S's steps and an M_L forward slow each other side by side on one GPU
(`sharing`: catch-ups in flight; gpu_sim --what-if shared), the two streams of one priority
and with either first (`first`: flight.ThreadLauncher.first). Last, M_L's ragged forwards
(`ragged`: static_ragged.py, each token bucket's replay time and the logits against the
padded path; gpu_sim --what-if ragged prices them so). The probes are benchmarks/gpu_probes.py.
Writes DIR/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import LoadSpec, load_chain
from backoff_core.models.prompts import encode_prompt
from backoff_core.runners.factory import make_runner
from backoff_core.runners.graph_plan import GraphKey
from backoff_core.runners.static import StaticRunner
from backoff_core.types import GenerationRequest, KVSpec, RoutingParams, SamplingParams, Verification
from benchmarks.gpu_plan import plan_default
from benchmarks.gpu_probes import median_ms, probes, ragged_probe, replay_table, sharing
from benchmarks.pair_args import pair_args

GIB = 2**30
ROUTINGS = {
    "always-small": RoutingParams(router="always-small"),
    "always-large": RoutingParams(router="always-large"),
    "random b=0.9": RoutingParams(router="random", rate=0.9),
    "draft K=4": RoutingParams(router="draft", draft_tokens=4, verification=Verification.EXACT),
}


def build(chain, kv: KVSpec) -> tuple[list, dict]:
    runners, measured = [], {}
    for i, (model, name) in enumerate(zip(chain.models, ("small", "large"))):
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        runner = make_runner(model, name, kv, small=i == 0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        added = torch.cuda.memory_reserved() - before
        kv_bytes, fused = runner.kv.nbytes(), runner._forward.fused_nbytes()
        measured[name] = {
            "graphs": len(runner.graphs),
            "build_and_capture_s": round(seconds, 2),
            "kv_gib": round(kv_bytes / GIB, 3),
            "weights_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / GIB, 3),
            "pool_gib": round((added - kv_bytes - fused) / GIB, 3),
            "fused_gib": round(fused / GIB, 3),  # M_S's fused projections (static_forward.py)
        }
        runners.append(runner)
    return runners, measured


@torch.inference_mode()
def logits_error(chain, runner, prompt_ids) -> float:
    """||ours - HF|| / ||HF|| of M_L's logits at the prompt's positions (both bf16)."""
    runner.open("check")
    got = runner.extend([("check", prompt_ids)])[0].logits
    runner.close("check")
    ref = chain.models[-1](torch.tensor([prompt_ids], device="cuda")).logits[0].float()
    return float((got - ref).norm() / ref.norm())


@torch.inference_mode()
def step_anatomy(run: StaticRunner, rows: int, prompt_ids: list[int]) -> dict:
    """One decode step of `rows` sessions holding the prompt: the whole extend, the graph's
    replay alone (events), and the kernels one replay launches."""
    ids = [f"anatomy{i}" for i in range(rows)]
    for r in ids:
        run.open(r)
        run.extend([(r, prompt_ids)], last_only=True)
    length = len(prompt_ids)

    def step():
        run.extend([(r, [5]) for r in ids], last_only=True)
        for r in ids:
            run.crop(r, length)

    extend_ms = median_ms(step)
    step()  # leaves the step's inputs in the static buffers
    key = GraphKey(True, rows, 1, run.length_buckets[0], True, None)
    graph = run.graphs._graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay = []
    for _ in range(50):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for r in ids:
        run.close(r)
    return {
        "rows": rows,
        "extend_ms": round(extend_ms, 3),
        "graph_replay_ms": round(sorted(replay)[25], 3),
        "kernels_per_replay": len(kernels),
    }


# M_S's forward as factory.make_runner builds it (fused projections and norms), then without
# the fused projections, then with HF's own modules throughout: the kernels each saves
PROBES = {
    "M_S fused projections and norms": (True, True),
    "M_S fused norms": (False, True),
    "M_S HF modules": (False, False),
}


def anatomy(chain, runners, prompt_ids) -> dict:
    out = {}
    for label, (projections, norms) in PROBES.items():
        probe = StaticRunner(
            chain.models[0], "probe", kv_budget_tokens=64 * 1024, max_len=1024, fuse_projections=projections
        )
        probe._forward.fused_norms = norms
        probe.warmup(last_only=(True,), ks=(1,), progress=False)
        out[label] = [step_anatomy(probe, rows, prompt_ids) for rows in (1, 64)]
        del probe
        torch.cuda.empty_cache()
    out["M_L"] = [step_anatomy(runners[-1], rows, prompt_ids) for rows in (1, 16)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    pair_args(ap)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/gpu")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    start = time.perf_counter()
    chain = load_chain(args.small, args.large, (), LoadSpec(args.device, args.dtype))
    load_s = time.perf_counter() - start
    runners, measured = build(chain, KVSpec(args.kv_budget, args.max_len))
    engine = BackoffEngine(
        runners, chain.tokenizer, context_window=chain.context_window, hidden_size=chain.models[0].config.hidden_size
    )
    prompt = encode_prompt(chain.tokenizer, "Write a short paragraph about the history of Python.", chat=True)
    error = logits_error(chain, runners[-1], prompt)
    eager_before = [r.eager_passes for r in runners]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_s": round(load_s, 1),
        "plan": plan_default(args.kv_budget, args.max_len)["models"],
        "measured": measured,
        # KVSpec ragged "auto" (the default): whether M_L kept its ragged graphs past warm-up's check
        "ragged_at_load": bool(runners[-1].ragged),
        "memory_reserved_gib": round(torch.cuda.memory_reserved() / GIB, 3),
        "large_logits_rel_err_vs_hf_bf16": error,
        "replay_ms": {name: replay_table(r) for name, r in zip(("small", "large"), runners)},
    }

    def save() -> None:
        """The report so far: a stage cut at its deadline keeps every section finished before."""
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")

    save()  # the graphs' replay times first: what gpu_sim prices every forward by
    runs = {}
    for label, routing in ROUTINGS.items():
        reqs = [
            GenerationRequest(tuple(prompt), SamplingParams(max_tokens=args.tokens, seed=i, ignore_eos=True), routing)
            for i in range(4)
        ]
        torch.cuda.synchronize()
        t = time.perf_counter()
        results = engine.generate_many(reqs)
        torch.cuda.synchronize()
        runs[label] = {
            "tokens": sum(len(r.token_ids) for r in results),
            "seconds": round(time.perf_counter() - t, 3),
            "from_small": sum(r.sources.count(0) for r in results),
        }
    report["eager_passes_after_load"] = [r.eager_passes - e for r, e in zip(runners, eager_before)]
    report["forward_passes"] = [r.forward_passes for r in runners]
    report["generate_many_4x"] = runs
    save()
    # diagnostics, each saved as it ends (the ragged one last: it captures what the load did not)
    for name, section in (
        ("step_anatomy", lambda: anatomy(chain, runners, prompt)),
        ("sharing", lambda: sharing(runners)),
        ("probes", lambda: probes(chain.models[0], runners, prompt)),
        ("ragged", lambda: ragged_probe(runners[-1], prompt)),
    ):
        try:
            report[name] = section()
        except Exception as exc:  # noqa: BLE001 - a diagnostic: keep the checks above either way
            report[name] = f"failed: {exc!r}"
        save()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
