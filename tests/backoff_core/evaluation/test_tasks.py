"""The shipped offline task set: loads in lm-eval's TaskManager from the packaged folder with
no hub, holds >= 300 items over >= 3 tasks, every answer valid (Python answers re-checked by
running Python), and the jsonl is what scripts/make_tasks.py regenerates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the eval extra; CI installs it (Makefile)

import yaml  # noqa: E402 - lm-eval's dependency

from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING, TASKS, tasks_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def _make_tasks():
    from scripts import make_tasks

    return make_tasks


@pytest.fixture(scope="module")
def docs():
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir()), include_defaults=False)
    loaded = manager.load(list(TASKS))["tasks"]
    return {name: (task, list(task.test_docs())) for name, task in loaded.items()}


def test_the_task_set_loads_offline_with_enough_items(docs, monkeypatch):
    assert set(docs) == set(TASKS)
    assert sum(len(d) for _, d in docs.values()) >= 300
    kinds = {task.OUTPUT_TYPE for task, _ in docs.values()}
    assert kinds == {"multiple_choice", "generate_until"}
    assert all(len(d) >= 80 for _, d in docs.values())


def test_every_answer_is_valid(docs):
    make_tasks = _make_tasks()
    for task, items in docs.values():
        for doc in items:
            if task.OUTPUT_TYPE == "multiple_choice":
                choices = task.doc_to_choice(doc)
                assert len(choices) == 4 and len(set(choices)) == 4, doc
                assert 0 <= task.doc_to_target(doc) < 4
            else:
                assert doc["answers"] and all(a.strip() for a in doc["answers"]), doc
            if "expression" in doc:  # Python: the answer is what Python itself says
                value = repr(make_tasks.python_value(doc["expression"]))
                answer = doc["choices"][doc["label"]] if "choices" in doc else doc["answers"][0]
                assert answer == value, doc
                if "choices" in doc:
                    assert sum(c == value for c in doc["choices"]) == 1, doc


def test_the_shipped_jsonl_is_what_the_script_regenerates():
    make_tasks = _make_tasks()
    fresh = {
        "python_mc": make_tasks.python_mc(),
        "python_qa": make_tasks.python_qa(),
        "everyday_mc": make_tasks.everyday_mc(),
        "everyday_qa": make_tasks.everyday_qa(),
    }
    for name, items in fresh.items():
        shipped = [json.loads(line) for line in (tasks_dir() / f"{name}.jsonl").read_text().splitlines()]
        assert shipped == items, name


def test_the_packaged_default_routing_is_the_serve_configs():
    config = yaml.safe_load((ROOT / "deployments" / "serve_config.yaml").read_text())
    small = next(d for d in config["applications"][0]["deployments"] if d["name"] == "SmallModel")
    assert small["user_config"]["router"] == DEFAULT_ROUTING.router
    assert tuple(small["user_config"]["thresholds"]) == DEFAULT_ROUTING.thresholds


@pytest.mark.parametrize("name", ["backoff_everyday_qa", "backoff_python_qa"])
def test_short_answers_score_the_same_as_a_chat_turn(docs, name):
    """As a chat turn (--apply_chat_template) the reply repeats the prompt's "A:" cue ("A:
    yellow") where the completion of the prompt is " yellow": both score as the answer, and a
    wrong answer behind the cue still scores 0."""
    task, items = docs[name]
    for doc in items[:20]:
        answer, wrong = doc["answers"][0], "zzz-not-an-answer"
        for reply in (f" {answer}", f"A: {answer}", f"A:{answer}", f" A: {answer} "):
            assert task.process_results(doc, [reply])["exact_match"] == 1.0, (reply, doc)
        assert task.process_results(doc, [f"A: {wrong}"])["exact_match"] == 0.0, doc
