"""Loader of the offline task set for lm-eval (`custom_dataset: !function utils.load`).

lm-eval imports this file by path from the task YAMLs' folder; it reads the jsonl beside it,
so the tasks work from any working directory with no hub. lm-eval also passes its
--metadata (and, from the CLI, the model args) as keywords: all but `jsonl` are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(jsonl: str, **_ignored):
    import datasets

    rows = [json.loads(line) for line in (HERE / jsonl).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
