"""The lm-eval model type `backoff`: with always-large it IS lm-eval's `--model hf` on M_L, item
for item (loglikelihood values within float tolerance, the same greedy flags, generations
and accuracy), on a small task in the tiny pair's vocabulary; routed settings score with
the routed teacher-forced distribution and count the backoff rate."""

from __future__ import annotations

import json
import math

import pytest

lm_eval = pytest.importorskip("lm_eval")  # the eval extra; CI installs it (Makefile)

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from backoff_core.evaluation.lm_model import BackoffLM, parse_thresholds  # noqa: E402
from tests.support.helpers import engine_for  # noqa: E402

MC_ITEMS = [  # "question" and four choices in the tiny vocabulary (w0..w45)
    {
        "question": " ".join(f"w{(7 * i + j) % 40 + 2}" for j in range(3 + i % 4)),
        "choices": [f"w{c}" for c in (5, 9, 13, 21)],
        "label": i % 4,
    }
    for i in range(12)
]
GEN_ITEMS = [
    {"question": " ".join(f"w{(5 * i + j) % 40 + 2}" for j in range(2 + i % 3)), "answer": "w7"} for i in range(6)
]


def _task_dir(root):
    root.mkdir(exist_ok=True)
    (root / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC_ITEMS))
    (root / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN_ITEMS))
    (root / "utils.py").write_text(
        "import json, pathlib, datasets\n"
        "def load(jsonl, **_):\n"
        "    p = pathlib.Path(__file__).parent / jsonl\n"
        "    return datasets.DatasetDict({'test': datasets.Dataset.from_list([json.loads(x) for x in p.read_text().splitlines()])})\n"
    )
    (root / "mc.yaml").write_text(
        "task: tiny_mc\noutput_type: multiple_choice\ntest_split: test\ncustom_dataset: !function utils.load\n"
        "dataset_kwargs:\n  jsonl: mc.jsonl\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n"
    )
    (root / "gen.yaml").write_text(
        "task: tiny_gen\noutput_type: generate_until\ntest_split: test\ncustom_dataset: !function utils.load\n"
        "dataset_kwargs:\n  jsonl: gen.jsonl\ndoc_to_text: '{{question}}'\ndoc_to_target: answer\n"
        "generation_kwargs:\n  until: ['w3']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n"
    )
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory, soft_pair, tokenizer):
    root = tmp_path_factory.mktemp("lm_eval")
    for name, model in zip(("small", "large"), soft_pair):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    large_dir = root / "large"
    return (
        engine_for(soft_pair, tokenizer),
        large_dir,
        TaskManager(include_path=str(_task_dir(root / "tasks")), include_defaults=False),
    )


def _run(lm, manager):
    out = simple_evaluate(
        model=lm, tasks=["tiny_mc", "tiny_gen"], task_manager=manager, log_samples=True, bootstrap_iters=0
    )
    return out["results"], out["samples"]


def test_always_large_equals_hf_item_for_item(setup):
    engine, large_dir, manager = setup
    ours, our_samples = _run(BackoffLM(engine=engine, router="always-large", batch_size=5), manager)
    hf = HFLM(pretrained=str(large_dir), device="cpu", dtype="float32", batch_size=1)
    theirs, their_samples = _run(hf, manager)
    for a, b in zip(our_samples["tiny_mc"], their_samples["tiny_mc"], strict=True):
        assert a["doc_id"] == b["doc_id"]
        for choice_a, choice_b in zip(a["resps"], b["resps"], strict=True):  # per choice: [(logprob, greedy)]
            (ll_a, greedy_a), (ll_b, greedy_b) = choice_a[0], choice_b[0]
            assert math.isclose(ll_a, ll_b, rel_tol=1e-4, abs_tol=1e-4), (a["doc_id"], ll_a, ll_b)
            assert greedy_a == greedy_b
        assert a["acc"] == b["acc"]
    for a, b in zip(our_samples["tiny_gen"], their_samples["tiny_gen"], strict=True):
        assert a["resps"][0][0].strip() == b["resps"][0][0].strip(), a["doc_id"]
        assert a["exact_match"] == b["exact_match"]
    assert sum(bool(s["resps"][0][0].strip()) for s in our_samples["tiny_gen"]) >= 3  # not vacuous
    assert ours["tiny_mc"]["acc,none"] == theirs["tiny_mc"]["acc,none"]
    assert ours["tiny_gen"]["exact_match,none"] == theirs["tiny_gen"]["exact_match,none"]


def test_routed_scores_count_the_backoff_rate(setup):
    engine, _, manager = setup
    small = BackoffLM(engine=engine, router="always-small")
    large = BackoffLM(engine=engine, router="always-large")
    half = BackoffLM(engine=engine, router="random", threshold=0.5)
    lls = {}
    for name, lm in (("small", small), ("large", large), ("half", half)):
        _, samples = _run(lm, manager)
        lls[name] = [r[0][0] for s in samples["tiny_mc"] for r in s["resps"]]
    assert small.usage.backoff_rate() == 1.0 and large.usage.backoff_rate() == 0.0
    assert 0.2 < half.usage.backoff_rate() < 0.8
    # every scored position of the half-and-half row is one model's or the other's: an item
    # whose continuation is one token equals small's or large's value exactly
    assert all(
        math.isclose(h, s, abs_tol=1e-5) or math.isclose(h, g, abs_tol=1e-5)
        for h, s, g in zip(lls["half"], lls["small"], lls["large"])
    )
    assert lls["small"] != lls["large"]


def test_backoff_lm_eval_runs_lm_evals_own_cli(setup, tmp_path):
    """`backoff lm-eval` = lm-eval's CLI with --model backoff registered, model_args as lm-eval
    passes them (small/large dirs, router, threshold)."""
    from backoff_core.cli.main import main

    _, large_dir, manager = setup
    small_dir = large_dir.parent / "small"
    argv = ["lm-eval", "--model", "backoff", "--model_args", f"small={small_dir},large={large_dir},router=always-large"]
    argv += ["--tasks", "tiny_mc", "--include_path", str(manager.include_path), "--output_path", str(tmp_path)]
    assert main(argv) == 0
    saved = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    results = saved["results"]
    assert str(saved["config"]["batch_size"]) == "32"  # not lm-eval's CLI default of 1: a batched engine
    ours, _ = _run(BackoffLM(engine=setup[0], router="always-large"), manager)
    assert results["tiny_mc"]["acc,none"] == ours["tiny_mc"]["acc,none"]


def test_thresholds_parse_from_model_args():
    assert parse_thresholds("5") == (5.0,)
    assert parse_thresholds("2:4.5") == (2.0, 4.5)
    assert parse_thresholds(None) is None and parse_thresholds(3) == (3.0,)
