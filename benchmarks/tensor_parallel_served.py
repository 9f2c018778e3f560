"""The app under real Ray Serve with M_L over tensor-parallel ranks, and one rank killed.

    python -m benchmarks.tensor_parallel_served           # TP=3 -> benchmarks/results/tensor_parallel_served.json
    python -m benchmarks.tensor_parallel_served --tp 2

The Serve tests' tiny M_S and the tensor-parallel tests' tiny M_L (tests/support/tp_models.py:
12 heads / 6 KV heads, so it splits over 2 and over 3 ranks) on the loopback config, one
replica of each deployment, `models.tensor_parallel.large: N`, in a fresh local Ray. Records:
how long the app took to start; for three greedy prompts whether the served tokens and
sources equal the in-process engine's (M_L at TP=1); then three 200-token requests in flight
while the LargeModel's rank 1 (a Ray actor in the replica's placement group,
deployments/rank_actors.py) is killed with SIGKILL: whether each completed, its tokens,
whether it was degraded, and when a new request was answered (Serve starting a new replica
with its ranks). A run of the real
path the tests cover on the Serve fakes (tests/deployments/test_large_tensor_parallel.py),
kept out of the suite for its start-up (minutes on two cores); a 2-core machine's times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from clients.http_client import BackoffHTTPClient
from tests.support.e2e_app import reference
from tests.support.served_app import TINY_PAIR, in_process_engine, running_app
from tests.support.tp_models import tp_model

OUT = Path("benchmarks/results/tensor_parallel_served.json")
PROMPTS = ([5, 9, 13, 2], [7, 8], [11, 12, 13])
ROUTING = dict(temperature=0, router="entropy", backoff_threshold=0.5)


MODELS = {"small": TINY_PAIR["small"], "large": tp_model}


def tensor_parallel(ranks: int, config: dict, dirs) -> None:
    config["applications"][0]["args"]["models"]["tensor_parallel"] = {"large": ranks}


def rank_processes() -> tuple[int, list[int]]:
    """The LargeModel replica's pid and its ranks' (Ray actors in its placement group, on its node)."""
    from ray import serve

    info = serve.get_deployment_handle("LargeModel", app_name="backoff").info.remote().result()
    assert all(node == info.node for node, _ in info.ranks), info.ranks  # STRICT_PACK: one node
    return info.pid, [pid for _, pid in info.ranks]


def equal_to_in_process(http, local) -> list[dict]:
    rows = []
    for prompt in PROMPTS:
        ref = reference(local, prompt, 24, router="entropy", thresholds=(0.5,))
        out = http.complete(prompt, max_tokens=24, ignore_eos=True, **ROUTING)
        same = (out.token_ids, out.sources) == (list(ref.token_ids), list(ref.sources))
        rows.append({"prompt": prompt, "equal": same, "large_calls": out.usage.large_calls})
    return rows


def kill_a_rank_mid_stream(http) -> dict:
    results: dict[int, dict] = {}

    def request(i: int, prompt: list[int]) -> None:
        start = time.monotonic()
        try:
            out = http.complete(prompt, max_tokens=200, ignore_eos=True, **ROUTING)
            results[i] = {"completed": True, "tokens": len(out.token_ids), "degraded": out.usage.degraded}
        except Exception as exc:  # noqa: BLE001 - recorded: a lost request is what this looks for
            results[i] = {"completed": False, "error": repr(exc)[:300]}
        results[i]["seconds"] = round(time.monotonic() - start, 1)

    replica, ranks = rank_processes()
    assert ranks, "the LargeModel reports no rank actor"
    threads = [threading.Thread(target=request, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    time.sleep(3)  # the requests are in their catch-ups
    os.kill(ranks[0], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(600)
    done = time.monotonic() - killed
    out = http.complete(list(PROMPTS[0]), max_tokens=24, ignore_eos=True, **ROUTING)
    return {
        "replica_pid": replica,
        "rank_pids": ranks,
        "requests": [results[i] for i in range(len(PROMPTS))],
        "in_flight_finished_s_after_kill": round(done, 1),
        "new_request_answered_s_after_kill": round(time.monotonic() - killed, 1),
        "new_request_tokens": len(out.token_ids),
        "lost": sum(not r["completed"] for r in results.values()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=3, help="M_L's ranks (the tiny M_L's 6 KV heads: 2, 3 or 6)")
    args = ap.parse_args(argv)
    start, load = time.monotonic(), os.getloadavg()[0]
    edit = functools.partial(tensor_parallel, args.tp)
    with tempfile.TemporaryDirectory() as root, running_app(Path(root), MODELS, edit=edit) as app:
        up = time.monotonic() - start
        local = in_process_engine(app.model_dirs["small"], app.model_dirs["large"])
        with BackoffHTTPClient(app.url) as http:
            equal = equal_to_in_process(http, local)
            killed = kill_a_rank_mid_stream(http)
    out = {
        "machine": f"{os.cpu_count()}-core CPU, no GPU; a fresh local Ray",
        "load_average_at_start": round(load, 2),
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "tensor_parallel": {"large": args.tp},
        "large_heads": {"attention": 12, "kv": 6},
        "app_up_s": round(up, 1),
        "greedy_equal_to_in_process_tp1": equal,
        "rank_killed": killed,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
