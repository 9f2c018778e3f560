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
    assert capsys.readouterr().err == "backoff-client: --top-p: Input should be less than or equal to 1\n"
    assert main(["--url", "http://127.0.0.1:9", "generate", "x"]) == 1  # nobody there


@pytest.mark.parametrize("value", ["abc", "1,,2", ""])
def test_a_bad_thresholds_flag_is_one_line_naming_it(capsys, value):
    from clients.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--url", "http://127.0.0.1:9", "generate", "x", "--thresholds", value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("backoff-client generate: argument --thresholds/--threshold: numbers separated by commas")


def test_the_cli_names_each_source_by_its_model(capsys):
    from clients.cli import _print_logprobs
    from clients.wire.logprobs import TokenLogprob
    from clients.wire.types import Usage

    entry = TokenLogprob(token="a", logprob=-0.5)
    _print_logprobs([entry] * 3, [0, 1, 1], Usage(completion_tokens=3, small_tokens=1, large_tokens=2))
    _print_logprobs([entry] * 2, [0, 1], Usage(completion_tokens=2, small_tokens=1, large_tokens=0))  # of 3 models
    names = [line.split()[1] for line in capsys.readouterr().err.splitlines()]
    assert names == ["small", "large", "large", "small", "medium1"]


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
