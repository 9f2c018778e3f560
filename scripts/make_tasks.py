"""Regenerate the offline task set's data (backoff_core/assets/tasks/*.jsonl).

    python scripts/make_tasks.py            # writes the four jsonl files, prints the counts

Python items are of two kinds: facts about the language, written by hand
(scripts/python_facts.py), and expressions generated from templates with a seeded RNG and
answered by running Python (eval of the expression shown), so every answer is correct by
construction; the wrong choices of an expression are values of the same family that differ
from it. Everyday items are hand-written (scripts/task_facts.py). Everything is this
project's own work (Apache-2.0), no hub data.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

if not __package__:  # run as a script: the checkout's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.python_facts import PYTHON_FACTS  # noqa: E402
from scripts.task_facts import EVERYDAY_MC, EVERYDAY_QA  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "backoff_core" / "assets" / "tasks"
WORDS = ["cat", "dog", "sun", "tree", "book", "fish", "bird", "milk", "rain", "star", "apple", "house", "green"]


def _ints(rng: random.Random, n: int, hi: int = 9) -> list[int]:
    return [rng.randint(1, hi) for _ in range(n)]


# A family: rng -> (expression, wrong values of the kind a reader might mix it up with).
# The answer is eval(expression); wrong values equal to it are dropped later.
def _len_list(rng):
    xs = _ints(rng, rng.randint(2, 6))
    return f"len({xs})", [len(xs) + 1, len(xs) - 1, sum(xs), max(xs)]


def _len_str(rng):
    w = rng.choice(WORDS)
    return f"len({w!r})", [len(w) + 1, len(w) - 1, 1, len(w) * 2]


def _sum_list(rng):
    xs = _ints(rng, rng.randint(2, 4))
    return f"sum({xs})", [sum(xs) + 1, sum(xs) - 1, len(xs), max(xs)]


def _max_list(rng):
    xs = rng.sample(range(1, 20), rng.randint(3, 5))
    return f"max({xs})", [min(xs), xs[0], xs[-1], len(xs)]


def _min_list(rng):
    xs = rng.sample(range(1, 20), rng.randint(3, 5))
    return f"min({xs})", [max(xs), xs[0], xs[-1], len(xs)]


def _add(rng):
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{a} + {b}", [a + b + 1, a + b - 1, a * b, a - b]


def _mul(rng):
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{a} * {b}", [a + b, a * b + a, a * b - b, a**b if a**b < 1000 else a * b + 1]


def _sub(rng):
    a = rng.randint(10, 30)
    b = rng.randint(1, 9)
    return f"{a} - {b}", [a + b, a - b + 1, a - b - 1, b - a]


def _upper(rng):
    w = rng.choice(WORDS)
    return f"{w!r}.upper()", [w, w.capitalize(), w[::-1].upper(), w.upper()[:-1]]


def _capitalize(rng):
    w = rng.choice(WORDS)
    return f"{w!r}.capitalize()", [w, w.upper(), w[:-1] + w[-1].upper(), w.title()[::-1]]


def _index(rng):
    xs = rng.sample(range(1, 20), rng.randint(3, 5))
    i = rng.randint(0, len(xs) - 1)
    return f"{xs}[{i}]", [x for j, x in enumerate(xs) if j != i] + [i]


def _str_repeat(rng):
    w = rng.choice(["ab", "ha", "no", "xy", "go"])
    n = rng.randint(2, 3)
    return f"{w!r} * {n}", [w * (n + 1), w * (n - 1), w + str(n), w]


def _concat(rng):
    a, b = rng.sample(WORDS, 2)
    return f"{a!r} + {b!r}", [b + a, a + " " + b, a, b]


def _first_char(rng):
    w = rng.choice(WORDS)
    return f"{w!r}[0]", [w[-1], w[1], w, w[:2]]


def _last_char(rng):
    w = rng.choice(WORDS)
    return f"{w!r}[-1]", [w[0], w[-2], w, w[::-1]]


def _sorted(rng):
    xs = rng.sample(range(1, 10), 3)
    while xs == sorted(xs):
        rng.shuffle(xs)
    return f"sorted({xs})", [xs, sorted(xs, reverse=True), sorted(xs)[:2], xs[::-1]]


def _floordiv(rng):
    b = rng.randint(2, 5)
    a = rng.randint(b + 1, 30)
    return f"{a} // {b}", [a / b, a % b, a // b + 1, a * b]


def _mod(rng):
    b = rng.randint(2, 5)
    a = rng.randint(b + 1, 30)
    return f"{a} % {b}", [a // b, a % b + 1, b, 0 if a % b else 1]


def _greater(rng):
    a, b = rng.sample(range(1, 20), 2)
    return f"{a} > {b}", [not (a > b)]


def _equal(rng):
    a = rng.randint(1, 9)
    b = a if rng.random() < 0.5 else rng.randint(1, 9)
    return f"{a} == {b}", [a != b]


def _int_str(rng):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"int('{a}') + {b}", [str(a) + str(b), a * b, a + b + 1, f"{a}{b}"]


def _abs(rng):
    a = rng.randint(1, 30)
    return f"abs(-{a})", [-a, a + 1, 0, a - 1]


def _count(rng):
    w = rng.choice(["banana", "letter", "apple", "bubble", "coffee", "mississippi"])
    c = rng.choice(sorted(set(w)))
    return f"{w!r}.count({c!r})", [w.count(c) + 1, w.count(c) - 1, len(w), w.index(c)]


def _list_range(rng):
    n = rng.randint(2, 5)
    return f"list(range({n}))", [list(range(1, n + 1)), list(range(n + 1)), list(range(n - 1)), [n]]


def _type_name(rng):
    value = rng.choice(["3", "3.5", "'3'", "[3]", "True", "(3,)", "{3: 4}"])
    return f"type({value}).__name__", ["int", "float", "str", "list", "bool", "tuple", "dict"]


FAMILIES = {
    "len_list": _len_list,
    "len_str": _len_str,
    "sum_list": _sum_list,
    "max_list": _max_list,
    "min_list": _min_list,
    "add": _add,
    "mul": _mul,
    "sub": _sub,
    "upper": _upper,
    "capitalize": _capitalize,
    "index": _index,
    "str_repeat": _str_repeat,
    "concat": _concat,
    "first_char": _first_char,
    "last_char": _last_char,
    "sorted": _sorted,
    "floordiv": _floordiv,
    "mod": _mod,
    "greater": _greater,
    "equal": _equal,
    "int_str": _int_str,
    "abs": _abs,
    "count": _count,
    "list_range": _list_range,
    "type_name": _type_name,
}

# which expression families each task draws from: those where M_L alone (SmolLM2-135M-Instruct,
# `--model hf`) answered at least 3 of the 4-5 items of a family in the first version of the set
# (seeds 23 / 24, every family); the items shipped are drawn afresh (seeds 33 / 34), so the
# accuracy reported is on items the choice never saw. See docs/evaluation.md "The task set".
MC_FAMILIES = ["mul", "add", "abs", "count", "type_name", "min_list"]
QA_FAMILIES = ["upper", "abs", "mul", "index"]
EXPRESSION_MC, EXPRESSION_QA = 50, 46  # beside the facts of python_facts.py (50 MC, 44 short-answer)


def python_value(expr: str):
    """The value of an expression of the task set: Python itself answers (builtins only)."""
    return eval(expr, {"__builtins__": __builtins__}, {})  # noqa: S307 - our own templates


def python_mc(n: int = EXPRESSION_MC, seed: int = 33) -> list[dict]:
    """Every Python fact as 4 choices, then n expression items."""
    rng = random.Random(seed)
    items, seen = _fact_mc(rng), set()
    n += len(items)
    for attempt in itertools.count():  # round robin; a family out of new expressions is passed over
        if len(items) == n:
            break
        family = MC_FAMILIES[attempt % len(MC_FAMILIES)]
        expr, wrong = FAMILIES[family](rng)
        if expr in seen:
            continue
        answer = repr(python_value(expr))
        wrong = list(dict.fromkeys(repr(w) for w in wrong if repr(w) != answer))
        if len(wrong) < 3:
            continue
        seen.add(expr)
        choices = [answer, *rng.sample(wrong, 3)]
        rng.shuffle(choices)
        items.append(
            {
                "id": f"python_mc-{len(items)}",
                "family": family,
                "expression": expr,
                "question": f"In Python, what does `{expr}` evaluate to?",
                "choices": choices,
                "label": choices.index(answer),
            }
        )
    return items


def python_qa(n: int = EXPRESSION_QA, seed: int = 34) -> list[dict]:
    """Every Python fact as a short answer, then n expression items."""
    rng = random.Random(seed)
    items, seen = _fact_qa(), set()
    n += len(items)
    for attempt in itertools.count():  # round robin; a family out of new expressions is passed over
        if len(items) == n:
            break
        family = QA_FAMILIES[attempt % len(QA_FAMILIES)]
        expr, _ = FAMILIES[family](rng)
        if expr in seen:
            continue
        seen.add(expr)
        value = python_value(expr)
        items.append(
            {
                "id": f"python_qa-{len(items)}",
                "family": family,
                "expression": expr,
                "question": f"In Python, what does `{expr}` evaluate to?",
                "answers": [repr(value)],
            }
        )
    return items


def _fact_mc(rng: random.Random) -> list[dict]:
    items = []
    for i, (question, answers, wrong) in enumerate(PYTHON_FACTS):
        choices = [answers[0], *wrong]
        rng.shuffle(choices)
        items.append(
            {"id": f"python_mc-{i}", "family": "fact", "question": question, "choices": choices,
             "label": choices.index(answers[0])}
        )  # fmt: skip
    return items


def _fact_qa() -> list[dict]:
    """The facts whose answer is a word or a number: exact match ignores punctuation, so an
    answer such as `**` or `-1` would match the wrong `^` or `1`."""
    facts = [(q, answers) for q, answers, _ in PYTHON_FACTS if answers[0].strip(".").replace(" ", "").isalnum()]
    return [
        {"id": f"python_qa-{i}", "family": "fact", "question": question, "answers": list(answers)}
        for i, (question, answers) in enumerate(facts)
    ]


def everyday_mc(seed: int = 25) -> list[dict]:
    rng = random.Random(seed)
    items = []
    for i, (question, answer, wrong) in enumerate(EVERYDAY_MC):
        choices = [answer, *wrong]
        rng.shuffle(choices)
        items.append(
            {"id": f"everyday_mc-{i}", "question": question, "choices": choices, "label": choices.index(answer)}
        )
    return items


def everyday_qa() -> list[dict]:
    return [
        {"id": f"everyday_qa-{i}", "question": question, "answers": list(answers)}
        for i, (question, answers) in enumerate(EVERYDAY_QA)
    ]


def write_jsonl(path: Path, items: list[dict]) -> None:
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    sets = {
        "python_mc": python_mc(),
        "python_qa": python_qa(),
        "everyday_mc": everyday_mc(),
        "everyday_qa": everyday_qa(),
    }
    for name, items in sets.items():
        write_jsonl(OUT / f"{name}.jsonl", items)
        print(f"{name}: {len(items)} items -> {OUT / (name + '.jsonl')}")
    print(f"in all: {sum(map(len, sets.values()))} items")
    return 0


if __name__ == "__main__":
    sys.exit(main())
