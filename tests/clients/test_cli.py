"""The `backoff-client` command line (clients/cli.py): its flags become the request's params,
and bad params are refused before anything is sent, reported as a client error."""

from __future__ import annotations

import pytest

from clients.wire.errors import BadRequestError
from clients.wire.types import GenerateParams, merge_params


def test_bad_params_are_refused_before_sending_and_the_cli_reports_them(capsys):
    from clients.cli import main

    with pytest.raises(BadRequestError, match="top_p"):
        merge_params(None, {"top_p": 5})
    assert main(["--url", "http://127.0.0.1:9", "generate", "x", "--top-p", "5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "generate", "x"]) == 1  # nobody there


def test_cli_flags_become_the_request_params():
    from clients.cli import _params, _parser

    args = _parser().parse_args(
        [
            "generate",
            "x",
            "--max-tokens",
            "7",
            "--temperature",
            "0",
            "--top-k",
            "5",
            "--seed",
            "3",
            "--stop",
            "a",
            "--stop",
            "b",
            "--ignore-eos",
            "--router",
            "entropy",
            "--threshold",
            "1.5,4",
            "--target-backoff",
            "0.8",
        ]
    )
    assert _params(args) == GenerateParams(
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        seed=3,
        stop=["a", "b"],
        ignore_eos=True,
        router="entropy",
        thresholds=[1.5, 4.0],
        target_backoff=0.8,
    )
    assert _params(_parser().parse_args(["generate", "x"])) == GenerateParams()
    assert _params(_parser().parse_args(["generate", "x", "--thresholds", "2"])).thresholds == [2.0]
