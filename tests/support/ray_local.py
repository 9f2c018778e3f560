"""Start the local Ray instance a Serve test module runs on.

Always a NEW local instance (`address="local"`: never a cluster named by $RAY_ADDRESS or a
stale /tmp/ray/ray_current_cluster), and a failed start is retried after a pause: on a
busy 2-core CI machine the processes of the previous module's instance may still be
exiting. Every failed attempt is reported, so a real fault is not hidden. The instance gets
serve_cli's local environment (a patient proxy ready check) as `backoff serve` does.

The test process never lets Ray start itself (`no_auto_init`): a Serve handle of an earlier
module may still get a late update after its Ray went down, and its `ray.get` would quietly
start a local instance of its own, which the next `ray.init` then refuses ("called ray.init
twice"), as CI once saw at the multi-node module.
"""

from __future__ import annotations

import sys
import time

ATTEMPTS = 3


def no_auto_init() -> None:
    """Ray calls in this process fail while Ray is down, instead of starting a local Ray
    (what RAY_ENABLE_AUTO_CONNECT=0 does, for this process only: Ray's own processes and the
    CLIs the tests start keep their environment)."""
    from ray._private import auto_init_hook

    auto_init_hook.enable_auto_connect = False


def start_local_ray(**kwargs) -> None:
    import ray

    from deployments.serve_cli import local_serve_env

    no_auto_init()
    local_serve_env()
    if ray.is_initialized():
        ray.shutdown()
    errors = []
    for attempt in range(1, ATTEMPTS + 1):
        try:
            ray.init(address="local", **{"include_dashboard": False, "log_to_driver": False, **kwargs})
            return
        except Exception as exc:  # noqa: BLE001 - reported below and on the last attempt
            errors.append(f"attempt {attempt}: {type(exc).__name__}: {exc}")
            print(f"ray.init failed ({errors[-1]})", file=sys.stderr)
            ray.shutdown()
            if attempt < ATTEMPTS:
                time.sleep(5.0 * attempt)
    raise RuntimeError("could not start a local Ray instance:\n" + "\n".join(errors))
