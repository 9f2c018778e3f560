"""The README's playground screenshot: the page in headless Chromium, one chat prompt run in
compare mode (always-large beside the entropy router at a threshold that mixes sources).

    python benchmarks/playground_shot.py                       # starts the default pair on Serve itself
    python benchmarks/playground_shot.py --url http://127.0.0.1:8000 [--api-key KEY]   # a running `backoff serve`

Saves benchmarks/results/playground.png and prints both panels' counters. Needs Debian's
chromium + chromium-driver (see tests/support/playground_page.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support
from tests.support.playground_page import PlaygroundPage, browser_missing  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."


def shoot(url: str, out: Path, api_key: str | None, threshold: float, max_tokens: int) -> None:
    with PlaygroundPage(url, width=1500, height=800) as page:
        if api_key:
            page.wait("return !document.getElementById('key-dialog').hidden", 30)
            page.enter_key(api_key)
        page.ready(60)
        page.set(prompt=PROMPT, mode="chat", temperature=0, max_tokens=max_tokens, seed=0, compare=True)
        page.set_panel("a", "always-large")
        page.set_panel("b", "entropy", [threshold])
        page.run(timeout_s=600)
        for name in ("a", "b"):
            state = page.panel(name)
            print(f"panel {name}: {state.status} {state.counters} {state.error}")
        print(f"saved {page.screenshot(out)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start the default pair here)")
    ap.add_argument("--api-key", help="the server's API key, if it has one")
    ap.add_argument("--threshold", type=float, default=5.0, help="entropy threshold of the right panel")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "playground.png")
    args = ap.parse_args()
    missing = browser_missing()
    if missing:
        sys.exit(missing)
    if args.url:
        return shoot(args.url, args.out, args.api_key, args.threshold, args.max_tokens)

    import ray
    from ray import serve

    from deployments import harness, serve_cli

    port = harness.free_port()
    serve_cli.start_ray(include_dashboard=False, log_to_driver=False)
    try:
        serve_cli.run_config(harness.loopback_config(None, None, port, harness.free_port(), threads=2), blocking=False)
        harness.wait_until_running("backoff")
        shoot(f"http://127.0.0.1:{port}", args.out, args.api_key, args.threshold, args.max_tokens)
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
