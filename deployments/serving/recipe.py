"""Cluster recipes (docs/cluster.md): the weights of a Serve config on every node, and the
KubeRay RayService that carries a Serve config. No Ray here.

  python -m deployments.serving.recipe weights ~/serve_config.yaml     # on each node, at setup
  python -m deployments.serving.recipe weights --model ORG/NAME ...    # a RayService's init container
  python -m deployments.serving.recipe rayservice my-pair.yaml > my-rayservice.yaml

The replicas load a Hugging Face id from the node's cache only (no download while Serve waits
for them), and a local path must be there on every node that may run the replica. `weights`
downloads each id into the cache (HF_HOME) and checks each local path; cluster.yaml runs it
on every GPU node at setup, the RayService's GPU pods in an init container.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from deployments.serving.config import AppArgs

TEMPLATE = Path(__file__).resolve().parents[2] / "recipes" / "gpu-pair" / "rayservice.yaml"
HF_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
SKIP = ["original/*", "*.pth"]  # Meta's own checkpoint copy in the Llama repos: the weights twice
WEIGHTS_INIT = "weights"  # the init container of a RayService worker group that runs `weights`
WEIGHTS_COMMAND = ["python", "-m", "deployments.serving.recipe", "weights"]  # its command, less the models


def models_of(config: dict) -> list[str]:
    """Every model path or id the config's applications load (M_S, the medium ones, M_L, a
    classifier router's head), in that order, once each; validated as the app reads them."""
    out: list[str] = []
    for app in config.get("applications", []):
        m = AppArgs.model_validate(app.get("args") or {}).models
        for name in (m.small, *m.medium, m.large, m.classifier):
            if name is not None and name not in out:
                out.append(name)
    return out


def fetch(models: list[str], download: Callable[..., str] | None = None) -> list[str]:
    """Each model on this node: a local path that exists is kept, a Hugging Face id is downloaded
    into the cache (`download`: huggingface_hub.snapshot_download); returns where each is.
    ValueError for a local path missing here (it must be on every node: a shared filesystem)."""
    where = []
    for name in models:
        path = Path(name).expanduser()
        if path.exists():
            where.append(str(path))
        elif name.startswith(("/", ".", "~")) or name.endswith(".gguf") or not HF_ID.match(name):
            raise ValueError(
                f"{name!r} is not on this node: a local model must be at the same path on every "
                "node (a shared filesystem), or name a Hugging Face id"
            )
        else:
            if download is None:
                from huggingface_hub import snapshot_download as download
            where.append(download(repo_id=name, ignore_patterns=SKIP))
    return where


def rayservice(config: dict, template: dict) -> dict:
    """`template` (a RayService manifest) carrying `config` as its serveConfigV2, and each worker
    group's weights init container fetching the config's models."""
    manifest = copy.deepcopy(template)
    manifest["spec"]["serveConfigV2"] = yaml.safe_dump(config, sort_keys=False)
    command = [a for m in models_of(config) for a in ("--model", m)]
    for group in manifest["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        for init in group["template"]["spec"].get("initContainers", []):
            if init["name"] == WEIGHTS_INIT:
                init["command"] = [*WEIGHTS_COMMAND, *command]
    return manifest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.serving.recipe", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("weights", help="put a Serve config's models on this node (HF cache), check local paths")
    w.add_argument("config", nargs="?", type=Path, help="Serve config YAML")
    w.add_argument("--model", action="append", default=[], help="a model id or path (instead of a config)")
    r = sub.add_parser("rayservice", help="print a RayService manifest carrying a Serve config")
    r.add_argument("config", type=Path, help="Serve config YAML")
    r.add_argument("--template", type=Path, default=TEMPLATE, help="RayService manifest to fill in")
    args = p.parse_args(argv)
    config = yaml.safe_load(args.config.read_text()) if args.config else {}
    try:
        if args.command == "weights":
            models = args.model or models_of(config)
            for name, where in zip(models, fetch(models)):
                print(f"weights: {name} at {where}", file=sys.stderr)
        else:
            manifest = rayservice(config, yaml.safe_load(args.template.read_text()))
            print(f"# KubeRay RayService carrying {args.config} (python -m deployments.serving.recipe rayservice)")
            print(yaml.safe_dump(manifest, sort_keys=False), end="")
    except ValueError as exc:
        print(f"recipe: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
