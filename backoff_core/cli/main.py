"""`backoff` command line: generate / demo / frontier / lm-eval in one process.

Other installed packages add subcommands through the `backoff.commands` entry-point group:
deployments/ adds `serve` (Ray Serve), so this package never imports it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time

from backoff_core.cli.args import (
    AUTO_BOOL,
    auto_bool,
    load_spec,
    model_args,
    parallel_args,
    routing_args,
    sampling_args,
)
from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING
from backoff_core.types import GenerationRequest, GenerationResult, KVSpec, RoutingParams, SamplingParams, Verification

PLUGIN_GROUP = "backoff.commands"
WARM_UP_TOKENS = 8  # the demo's untimed first request, which runs both models

# ANSI colours per source level: smallest plain green, largest bold red, middle yellow
_COLOURS = {0: "\033[32m", 1: "\033[33m"}
_TOP = "\033[1;31m"
_RESET = "\033[0m"


def _plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Subcommands other installed packages register (group `backoff.commands`)."""
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backoff", description="Backoff decoding with a small and a large LM.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text in this process")
    model_args(gen)
    parallel_args(gen)
    routing_args(gen)
    sampling_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument(
        "--launch-ahead",
        nargs="?",
        choices=AUTO_BOOL,
        default="auto",
        const="true",
        help="M_S's next step queued before its tokens are read back, hiding the host's work between steps "
        "(docs/gpu.md); the same tokens. auto (the default): with --kv-budget on CUDA; true (alone: true): "
        "with --kv-budget; false",
    )
    demo = sub.add_parser("demo", help="the embedded default pair at a few thresholds, coloured by source")
    demo.add_argument("--prompt", default="Explain in two sentences why the sky is blue.")
    demo.add_argument("--max-tokens", type=int, default=48)
    tok = sub.add_parser(
        "export-tokenizer",
        help="save the chain's tokenizer as a plain directory (what lm-eval's tokenizer= and other tools load)",
    )
    tok.add_argument("out", help="directory to write (tokenizer.json, tokenizer_config.json, ...)")
    tok.add_argument(
        "--model", default=None, help="a model directory, cached hub id or .gguf file (default: the default pair's)"
    )
    for name, entry in _plugins().items():
        sub.add_parser(name, help=f"(from {entry.module}; `backoff {name} --help`)", add_help=False)
    try:
        from backoff_core.cli.router import register  # router-data / router-train / router-calibrate / evaluate
    except ImportError:
        register = None
    if register is not None:
        register(sub)
    from backoff_core.cli.frontier import register as register_frontier  # frontier (needs the eval extra to run)

    register_frontier(sub)
    from backoff_core.cli.quantize import register as register_quantize  # quantize (an fp8 checkpoint)

    register_quantize(sub)
    sub.add_parser("lm-eval", help="lm-eval's own CLI with `--model backoff` registered (`backoff lm-eval --help`)")
    return parser


def request_from_args(args, prompt_ids: list[int]) -> GenerationRequest:
    thresholds = args.threshold  # parsed and checked by argparse (args.thresholds_arg)
    verification = args.verification or ("exact" if args.mode == "speculative" else "none")
    router = "draft" if args.mode == "speculative" else args.router or DEFAULT_ROUTING.router
    if args.router is None and thresholds is None and args.rate is None and args.target_backoff is None:
        if router == DEFAULT_ROUTING.router and not getattr(args, "medium", None):  # a pair, no routing named
            thresholds = DEFAULT_ROUTING.thresholds  # the packaged default (serve_config.yaml's)
    return GenerationRequest(
        prompt_ids=tuple(prompt_ids),
        sampling=SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        ),
        routing=RoutingParams(
            router=router,
            thresholds=thresholds,
            rate=args.rate,
            target_backoff=args.target_backoff,
            draft_tokens=args.draft_tokens,
            draft_schedule=args.draft_schedule,
            verification=Verification(verification),
            tolerance=args.tolerance,
            eager_prefill=args.eager_prefill,
        ),
    )


def result_json(result: GenerationResult) -> dict:
    t = result.timings
    top = result.num_levels - 1
    n = len(result.token_ids)
    decode_s = max(t.total - t.first_token, 1e-9)
    return {
        "text": result.text,
        "token_ids": list(result.token_ids),
        "sources": list(result.sources),
        "backoff_rate": result.backoff_rate,
        "large_calls": result.large_calls,
        "tokens_by_source": list(result.tokens_by_source()),
        "catch_up_lengths": [c.length - c.prompt_tokens for c in result.catch_ups if c.level == top],
        "rollbacks": result.rollbacks,
        "finish_reason": result.finish_reason.value,
        "prompt_tokens": result.prompt_tokens,
        "first_token_latency_s": t.first_token,
        "tokens_per_s": (n - 1) / decode_s if n > 1 else 0.0,
        "total_s": t.total,
        "c_S_median_s": statistics.median(t.small_steps) if t.small_steps else None,
        "c_r_median_s": statistics.median(t.router_steps) if t.router_steps else None,
        "P_L_s": [[c.length, c.seconds] for c in result.catch_ups if c.level == top],
        "thresholds": list(result.thresholds),
        "final_thresholds": list(result.thresholds),  # deprecated name of "thresholds"
    }


def coloured(tokenizer, result: GenerationResult) -> str:
    """The generated text with each token coloured by its source."""
    out, prev = [], ""
    ids = list(result.token_ids)
    for i, source in enumerate(result.sources):
        text = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        piece, prev = text[len(prev) :], text
        colour = _TOP if source == result.num_levels - 1 else _COLOURS.get(source, "")
        out.append(f"{colour}{piece}{_RESET}")
    return "".join(out)


def summary(result: GenerationResult) -> str:
    r = result_json(result)
    return (
        f"backoff rate {r['backoff_rate']:.2f} · tokens by source {r['tokens_by_source']} · "
        f"large calls {r['large_calls']} · rollbacks {r['rollbacks']} · "
        f"first token {r['first_token_latency_s'] * 1000:.0f} ms · {r['tokens_per_s']:.1f} tok/s"
    )


def _generate(args) -> int:
    from backoff_core.engine import ahead
    from backoff_core.engine.engine import BackoffEngine
    from backoff_core.models.loading import load_chain
    from backoff_core.models.prompts import encode_prompt

    for which in ("small", "large"):
        if getattr(args, f"quantize_{which}") == "fp8" and getattr(args, f"{which}_tp") > 1:
            raise SystemExit(f"--quantize-{which} fp8 over --{which}-tp ranks is not built yet: use one or the other")
    chain = load_chain(args.small, args.large, args.medium, load_spec(args))
    kv = (
        KVSpec(
            args.kv_budget,
            args.max_len,
            not args.no_cuda_graphs,
            ragged=args.ragged_catch_ups,
            compile=args.compile_layers,
        )
        if args.kv_budget
        else None
    )
    if args.launch_ahead == "true" and kv is None:
        raise SystemExit("--launch-ahead needs static KV: give --kv-budget")
    if args.small_tp > 1 or args.large_tp > 1:
        from backoff_core.parallel.ranks import engine_from_chain

        sizes = [args.small_tp, *[1] * len(args.medium), args.large_tp]
        engine = engine_from_chain(chain, sizes, kv=kv, classifier_path=args.classifier)
    else:
        engine = BackoffEngine.from_chain(chain, kv=kv, classifier_path=args.classifier)
    engine.launch_ahead = ahead.resolve(auto_bool(args.launch_ahead), engine.models[0])
    request = request_from_args(args, encode_prompt(chain.tokenizer, args.prompt, args.chat))
    result = engine.generate(request)
    if args.json:
        print(json.dumps(result_json(result)))
    else:
        print(coloured(chain.tokenizer, result))
        print(f"\n[{summary(result)}]   legend: {_COLOURS[0]}small{_RESET} {_TOP}large{_RESET}")
    return 0


def _demo(args) -> int:
    from backoff_core.engine.engine import BackoffEngine
    from backoff_core.models.loading import load_chain
    from backoff_core.models.prompts import encode_prompt

    print("loading the embedded default pair (SmolLM2-135M-Instruct + its distilled 5-layer student)…")
    start = time.perf_counter()
    chain = load_chain(None, None)
    engine = BackoffEngine.from_chain(chain)
    print(f"loaded in {time.perf_counter() - start:.1f} s\n\nprompt: {args.prompt}\n")
    prompt_ids = encode_prompt(chain.tokenizer, args.prompt, chat=True)
    # untimed: each model's first forwards pay one-time costs (kernel choice, allocations), which
    # would otherwise land in the first run's first-token time and tok/s alone
    warm = RoutingParams(router="random", rate=0.5)
    engine.generate(GenerationRequest(tuple(prompt_ids), SamplingParams(max_tokens=WARM_UP_TOKENS), warm))
    # M_L alone; the packaged default (keeps >= 95% of M_L's accuracy on the task set: little
    # backoff on this pair); entropy 3.5, more on M_S and less faithful (0.81 of M_L); M_S alone
    default = DEFAULT_ROUTING.thresholds[0]
    runs = [("always-large", None, ""), (DEFAULT_ROUTING.router, default, ", the packaged default")]
    runs += [("entropy", 3.5, ", more on M_S, less faithful"), ("always-small", None, "")]
    for router, threshold, note in runs:
        routing = RoutingParams(router=router, thresholds=(threshold,) if threshold is not None else None)
        result = engine.generate(
            GenerationRequest(tuple(prompt_ids), SamplingParams(max_tokens=args.max_tokens), routing)
        )
        label = router + (f" (threshold {threshold:g}{note})" if threshold is not None else "")
        print(f"── {label}\n{coloured(chain.tokenizer, result)}\n[{summary(result)}]\n")
    print(f"legend: {_COLOURS[0]}small{_RESET} {_TOP}large{_RESET}")
    return 0


def _export_tokenizer(args) -> int:
    """The default pair's tokenizer lives inside a GGUF file, which tools that take a tokenizer
    directory (lm-eval's `tokenizer=`, vLLM's, transformers' AutoTokenizer without gguf_file)
    cannot read: write it out once. Both models of the pair share it."""
    from backoff_core.models.default_pair import find_large_gguf
    from backoff_core.models.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model or str(find_large_gguf()))
    written = tokenizer.save_pretrained(args.out)
    print(f"wrote {len(written)} files to {args.out} (vocab {len(tokenizer)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = _plugins()
    if argv and argv[0] in plugins:
        return plugins[argv[0]].load()(argv[1:])
    if argv and argv[0] == "lm-eval":  # everything after it is lm-eval's (`lm_eval` arguments)
        from backoff_core.cli.frontier import lm_eval_main

        return lm_eval_main(argv[1:])
    if argv and argv[0] == "serve":
        print("backoff: error: `backoff serve` comes with the serve extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "export-tokenizer":
            return _export_tokenizer(args)
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"backoff: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
