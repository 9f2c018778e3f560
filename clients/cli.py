"""`backoff-client`: talk to a running Backoff Serve over HTTP or gRPC.

  backoff-client generate "Why is the sky blue?" --chat --stream --thresholds 2.5
  backoff-client --grpc 127.0.0.1:9000 generate "def fib(n):" --max-tokens 32 --json
  backoff-client models | health
The API key comes from --api-key or, better (no shell history), BACKOFF_API_KEY.
Streamed tokens are coloured by source: small green, any larger model bold red.
"""

from __future__ import annotations

import argparse
import json
import sys

from clients.wire.errors import BackoffError, BadRequestError, TransportError
from clients.wire.logprobs import TokenLogprob
from clients.wire.types import ChatMessage, GenerateParams, Usage, merge_params

_SMALL, _LARGER, _RESET = "\033[32m", "\033[1;31m", "\033[0m"


class _Parser(argparse.ArgumentParser):
    """argparse's, whose errors are one line naming the flag (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def _thresholds(text: str) -> list[float]:
    """--thresholds "2,4" -> [2.0, 4.0] (that they ascend is the server's to check)."""
    try:
        return [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"numbers separated by commas (e.g. 2.5 or 2,4), got {text!r}") from None


# GenerateParams' fields that the command line spells otherwise
_FLAGS = {"logprobs": "--logprobs", "thresholds": "--thresholds", "max_tokens": "--max-tokens"}


def _flag(param: str | None) -> str | None:
    if not param:
        return None
    name = param.split(".")[0]
    return _FLAGS.get(name, "--" + name.replace("_", "-"))


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="backoff-client", description="Client of Backoff Serve (HTTP or gRPC).")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP base URL of the ingress")
    where.add_argument("--grpc", metavar="HOST:PORT", help="use gRPC at this address instead of HTTP")
    p.add_argument("--model", default=None, help="served model name (default: the server's)")
    p.add_argument("--api-key", default=None, help="API key (default: the BACKOFF_API_KEY environment variable)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt (or one chat message with --chat)")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are committed")
    gen.add_argument("--json", action="store_true", help="print the result as one JSON object")
    gen.add_argument("--no-color", action="store_true", help="do not colour tokens by source")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--router", help="decision function for this request")
    gen.add_argument(
        "--thresholds",
        "--threshold",
        dest="thresholds",  # --threshold: the old spelling
        type=_thresholds,
        help="threshold(s) on the router's score, comma-separated, ascending",
    )
    gen.add_argument("--target-backoff", type=float, help="target backoff rate")
    gen.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="print each token's log-probability under its source model, with N alternatives (0..20)",
    )
    gen.add_argument(
        "--echo",
        action="store_true",
        help="print the prompt before the completion; with --logprobs also each prompt token's, under the "
        "request's routed teacher-forced distribution (--max-tokens 0: score the prompt only)",
    )
    sub.add_parser("models", help="list the served model names")
    sub.add_parser("health", help="exit 0 when the server answers")
    return p


def _client(args):
    if args.grpc:
        from clients.grpc_client import BackoffGrpcClient

        return BackoffGrpcClient(args.grpc, model=args.model, api_key=args.api_key, timeout=args.timeout)
    from clients.http_client import BackoffHTTPClient

    return BackoffHTTPClient(args.url, model=args.model, api_key=args.api_key, timeout=args.timeout)


def _params(args) -> GenerateParams:
    """The flags as request fields; BadRequestError (naming the field) before anything is sent."""
    return merge_params(
        None,
        dict(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            router=args.router,
            logprobs=args.logprobs,
            thresholds=args.thresholds,
            target_backoff=args.target_backoff,
            echo=args.echo,
        ),
    )


def _colour(text: str, source: int | None, plain: bool) -> str:
    if plain or source is None:
        return text
    return f"{_SMALL if source == 0 else _LARGER}{text}{_RESET}"


def _summary(usage: Usage) -> str:
    return (
        f"[{usage.completion_tokens} tokens · backoff rate {usage.backoff_rate:.2f} · small {usage.small_tokens}"
        f" · large {usage.large_tokens} · large calls {usage.large_calls}]"
    )


def _namer(sources: list[int], usage: Usage | None):
    """source -> the model's name (DESIGN's glossary): 0 small; the largest source, where usage
    counts its tokens as large ones (or says nothing), is M_L: "large"; any other source a
    medium model of a longer chain."""
    counted = [s for s in sources if s is not None]
    top = max(counted, default=0)
    large = top if top and (usage is None or usage.large_tokens == counted.count(top)) else None

    def name(source: int) -> str:
        return "small" if source == 0 else "large" if source == large else f"medium{source}"

    return name


def _print_logprobs(entries: list[TokenLogprob], sources: list[int], usage: Usage | None = None) -> None:
    """One line per token on stderr: source, log-probability, token, then the alternatives."""
    name = _namer(sources, usage)
    for i, (e, source) in enumerate(zip(entries, sources)):
        top = ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in e.top_logprobs)
        print(f"{i:>4} {name(source):>7} {e.logprob:9.4f} {e.token!r}" + (f"  [{top}]" if top else ""), file=sys.stderr)


def _generate(client, args) -> None:
    params = _params(args)
    messages = [ChatMessage(role="user", content=args.prompt)]
    if args.stream:
        stream = client.stream_chat(messages, params) if args.chat else client.stream(args.prompt, params)
        usage, entries, sources = None, [], []
        for delta in stream:
            if delta.usage is not None:
                usage = delta.usage
            if delta.logprobs is not None:  # a rollback retracts the entries of the tokens it drops
                del entries[len(entries) - delta.retracted :], sources[len(sources) - delta.retracted :]
                entries.append(delta.logprobs)
                sources.append(delta.source)
            print(_colour(delta.text, delta.source, args.no_color), end="", flush=True)
        print()
        _print_logprobs(entries, sources, usage)
        if usage is not None:
            print(_summary(usage), file=sys.stderr)
        return
    result = client.chat(messages, params) if args.chat else client.complete(args.prompt, params)
    if args.json:
        print(json.dumps(result.model_dump()))
        return
    print(result.text)
    if result.prompt_logprobs:  # echo: the prompt's first (nothing scores its first token)
        scored = [(e, s) for e, s in zip(result.prompt_logprobs, result.prompt_sources or []) if e is not None]
        print("prompt:", file=sys.stderr)  # usage counts generated tokens only: the prompt's sources name themselves
        _print_logprobs([e for e, _ in scored], [s for _, s in scored])
        print("completion:", file=sys.stderr)
    _print_logprobs(result.logprobs or [], result.sources, result.usage)
    print(_summary(result.usage), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with _client(args) as client:
            if args.command == "models":
                print("\n".join(client.models()))
            elif args.command == "health":
                ok = client.health()
                print("ok" if ok else "unavailable")
                return 0 if ok else 1
            else:
                _generate(client, args)
    except BadRequestError as exc:  # the flag's value (checked here) or the server's refusal, in one line
        flag, message = _flag(exc.param), exc.message
        if flag and message.startswith(f"{exc.param}: "):  # the field's name, said once as the flag's
            message = message[len(exc.param) + 2 :]
        print(f"backoff-client: {flag + ': ' if flag else ''}{message}", file=sys.stderr)
        return 2
    except BackoffError as exc:
        print(f"backoff-client: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1 if isinstance(exc, TransportError) else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
