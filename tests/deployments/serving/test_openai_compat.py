"""The HTTP API as OpenAI's spec and vLLM's own server tests define it, asserted with the
official `openai` client (and raw JSON where the client hides a field): the Ingress over a
SmallModel and a LargeModel of tiny models (tests/support/serve_fakes.py), served by uvicorn
on a loopback port. No Ray.

Stream usage (OpenAI: only with stream_options.include_usage, then in one last chunk whose
`choices` is empty), n > 1 and batches without an unrequested empty chunk, GET /v1/models/{id},
the developer role and custom roles, vLLM's request fields (allowed_token_ids,
truncate_prompt_tokens, return_token_ids, return_tokens_as_token_ids honoured;
logprob_token_ids and structured_outputs refused by name), the sampled token first in a
completion's top_logprobs, prompt_logprobs null, an echoed prompt's special tokens, and the
Ingress's one log line per request.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from deployments import ingress
from tests.support.remote_fakes import LoopThread
from tests.support.serve_fakes import FakeHandle, ingress_replica, large_replica, serving, small_replica
from tests.support.tiny import tiny_tokenizer

openai = pytest.importorskip("openai")

# the role's own word before each message: which role reached the template shows in the prompt's ids
TEMPLATE = (
    "{% for m in messages %}{{ {'system': 'w1', 'developer': 'w2', 'user': 'w3', 'assistant': 'w4'}"
    ".get(m['role'], 'w9') }} {{ m['content'] }} {% endfor %}"
)
W = {f"w{i}": i + 2 for i in range(40)}  # tiny_tokenizer's ids: <eos> 0, <unk> 1, then w0, w1, ...
CONTEXT = 512  # tiny_model's max_position_embeddings
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def url(pair):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    lt = LoopThread()
    with pytest.MonkeyPatch.context() as patch:
        large = large_replica(patch, pair[1])
        routing = {"routing": {"router": "entropy", "thresholds": [0.4]}}  # both models serve
        small = small_replica(patch, pair[0], tokenizer, [FakeHandle([large], lt)], routing)
        ingress_replica(patch, small)
        try:
            with serving(ingress.app) as base:
                yield base
        finally:
            small.loop.stop()
            large.batcher.shutdown()
            lt.stop()


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": "backoff", **body}, timeout=60)


# -- 1, 2: stream usage and empty-choices chunks -------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat", "completion n=2", "chat n=2", "batch"])
def test_stream_usage_comes_only_when_asked_in_a_last_chunk_with_no_choices(client, kind):
    """OpenAI's include_usage: 'an additional chunk ... before data: [DONE]: usage ... the choices
    field will always be an empty array; all other chunks will also include a usage field, but
    with a null value'; without it, no usage and no chunk without a choice (chunk.choices[0] is
    safe: vLLM's test_completion_stream_options / test_chat_completion_stream_options)."""
    n = 2 if "n=2" in kind else 1
    prompts = ["w3 w4", "w5"] if kind == "batch" else "w3 w4"

    def stream(**options):
        if kind.startswith("chat"):
            messages = [{"role": "user", "content": "w3 w4"}]
            made = client.chat.completions.create(
                model="backoff", messages=messages, max_tokens=4, n=n, stream=True, **GREEDY, **options
            )
        else:
            made = client.completions.create(
                model="backoff", prompt=prompts, max_tokens=4, n=n, stream=True, **GREEDY, **options
            )
        return list(made)

    choices = n * (2 if kind == "batch" else 1)
    plain = stream()
    assert all(c.usage is None and c.choices for c in plain)
    assert [c.choices[0].finish_reason for c in plain].count("length") == choices
    for asked in (False, True):
        chunks = stream(stream_options={"include_usage": asked})
        assert all(c.usage is None and c.choices for c in chunks[: len(chunks) - asked])
        assert len(chunks) == len(plain) + asked
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 4 * choices
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens > 4 * choices


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_stream_options_without_stream_is_a_400_naming_it(client, url, path):
    """vLLM's validate_stream_options: 'Stream options can only be defined when stream=True'."""
    content = {"prompt": "w3"} if path == "completions" else {"messages": [{"role": "user", "content": "w3"}]}
    for stream in (False, None):
        body = {**content, "max_tokens": 2, "stream_options": {"include_usage": True}}
        response = _post(url, path, body if stream is None else {**body, "stream": stream})
        assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="backoff", prompt="w3", max_tokens=2, stream_options={"include_usage": True})
    refused = _post(url, path, {**content, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"


# -- 3: GET /v1/models/{id} ------------------------------------------------------------------------


def test_models_are_retrieved_by_id_with_root_and_max_model_len(client, url):
    model = client.models.retrieve("backoff")
    assert (model.id, model.object, model.owned_by) == ("backoff", "model", "backoff-serve")
    assert model.model_extra["max_model_len"] == CONTEXT and model.model_extra["root"]
    listed = client.models.list().data
    assert [m.id for m in listed] == ["backoff"] and listed[0].model_extra == model.model_extra
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-9")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert httpx.get(f"{url}/v1/models/org/name", timeout=30).status_code == 404  # an id with a slash


# -- 4: roles ---------------------------------------------------------------------------------------


def test_the_developer_role_and_custom_roles_reach_the_chat_template(client):
    """OpenAI's developer role (its system messages' successor) and any role vLLM passes to the
    template (the template decides): the role's word heads its message in the prompt."""
    roles = {"system": "w1", "developer": "w2", "user": "w3", "narrator": "w9"}
    for role, word in roles.items():
        out = client.chat.completions.create(
            model="backoff",
            messages=[{"role": role, "content": "w5"}],
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        assert out.model_extra["prompt_token_ids"] == [W[word], W["w5"]], role
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="backoff", messages=[{"role": "", "content": "w5"}], max_tokens=1)
    assert err.value.body["param"] == "messages.0.role"


# -- 5: vLLM's fields ------------------------------------------------------------------------------


def test_allowed_token_ids_bound_every_model_s_tokens(client):
    """vLLM's test_allowed_token_ids: every token drawn is one of them, M_S's and M_L's alike."""
    allowed = [W["w7"], W["w11"], W["w30"]]
    for router, source in (("always-small", 0), ("always-large", 1)):
        extra = {"allowed_token_ids": allowed, "ignore_eos": True, "return_token_ids": True, "router": router}
        out = client.completions.create(
            model="backoff", prompt="w3 w4", max_tokens=24, temperature=1.0, seed=3, extra_body=extra
        )
        ids = out.choices[0].model_extra["token_ids"]
        assert len(ids) == 24 and set(ids) <= set(allowed) and len(set(ids)) > 1, router
        assert set(out.choices[0].model_extra["backoff"]["sources"]) == {source}
    with pytest.raises(openai.BadRequestError, match=r"allowed_token_ids must be in \[0, 48\)"):
        client.completions.create(model="backoff", prompt="w3", max_tokens=1, extra_body={"allowed_token_ids": [48]})


def test_truncate_prompt_tokens_keeps_the_prompt_s_last_tokens(client):
    """vLLM's test_truncate_prompt_tokens: usage.prompt_tokens is the truncation size."""
    prompt = [W[f"w{i}"] for i in range(10)]
    out = client.completions.create(
        model="backoff", prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True}
    )
    assert out.usage.prompt_tokens == 3 and out.choices[0].model_extra["prompt_token_ids"] == prompt[-3:]
    whole = client.completions.create(
        model="backoff", prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens == 10  # -1: the context window's worth
    chat = client.chat.completions.create(
        model="backoff",
        messages=[{"role": "user", "content": "w5 w6 w7"}],
        max_tokens=1,
        extra_body={"truncate_prompt_tokens": 2},
    )
    assert chat.usage.prompt_tokens == 2


def test_return_token_ids_unary_and_streamed_agree(client):
    """vLLM's test_return_token_ids: the choice's token_ids and prompt_token_ids; streamed, each
    chunk its own ids and the prompt's on the first chunk only."""
    prompt = [W["w3"], W["w4"]]
    extra = {"return_token_ids": True, "ignore_eos": True}
    unary = client.completions.create(model="backoff", prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)
    choice = unary.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    assert choice["token_ids"] == choice["backoff"]["token_ids"]
    chunks = list(
        client.completions.create(
            model="backoff", prompt=prompt, max_tokens=6, temperature=0, stream=True, extra_body=extra
        )
    )
    assert [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks][:2] == [prompt, None]
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == choice["token_ids"]

    messages = [{"role": "user", "content": "w5"}]
    chat = client.chat.completions.create(
        model="backoff", messages=messages, max_tokens=4, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_token_ids"] == [W["w3"], W["w5"]]
    assert chat.choices[0].model_extra["token_ids"] == chat.choices[0].model_extra["backoff"]["token_ids"]
    plain = client.completions.create(model="backoff", prompt=prompt, max_tokens=2)
    assert plain.choices[0].model_extra["token_ids"] is None  # not asked: null, as vLLM's


def test_return_tokens_as_token_ids_names_every_logprob_token_by_id(client):
    """vLLM's test_return_tokens_as_ids: logprobs tokens are 'token_id:{id}', the ids generated."""
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = client.completions.create(model="backoff", prompt="w3 w4", max_tokens=5, logprobs=2, extra_body=extra)
    ids = out.choices[0].model_extra["token_ids"]
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]
    echoed = client.completions.create(
        model="backoff", prompt=[W["w3"], W["w4"]], max_tokens=2, logprobs=1, echo=True, extra_body=extra
    )
    ids = [W["w3"], W["w4"], *echoed.choices[0].model_extra["token_ids"]]
    assert echoed.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]  # the prompt's first too
    assert all(k.startswith("token_id:") for top in out.choices[0].logprobs.top_logprobs for k in top)
    chat = client.chat.completions.create(
        model="backoff",
        messages=[{"role": "user", "content": "w3"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(c.bytes == list(c.token.encode()) for c in content)


@pytest.mark.parametrize(
    "field, value",
    [("logprob_token_ids", [3, 4]), ("structured_outputs", {"choice": ["w3", "w4"]}), ("guided_choice", ["w3"])],
)
@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_vllm_fields_not_implemented_are_refused_by_name(url, path, field, value):
    content = {"prompt": "w3"} if path == "completions" else {"messages": [{"role": "user", "content": "w3"}]}
    response = _post(url, path, {**content, "max_tokens": 1, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_the_sampled_token_comes_first_in_a_completion_s_top_logprobs(client, url):
    """vLLM's order (OpenAI's at most logprobs + 1 entries): the sampled token, then the top-n;
    our client reads the top-n back, most likely first."""
    from clients.http_client import BackoffHTTPClient

    out = client.completions.create(model="backoff", prompt="w3 w4", max_tokens=12, temperature=1.0, seed=1, logprobs=2)
    lp = out.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert next(iter(top.items())) == (token, value) and len(top) in (2, 3)
        assert sorted(list(top.values())[1:], reverse=True) == list(top.values())[1:]
    assert any(len(top) == 3 for top in lp.top_logprobs)  # a sampled token outside the top 2
    with BackoffHTTPClient(url) as ours:
        got = ours.complete("w3 w4", max_tokens=12, temperature=1.0, seed=1, logprobs=2)
    for entry, top in zip(got.logprobs, lp.top_logprobs):
        want = sorted(top.items(), key=lambda kv: -kv[1])[:2]
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == want


def test_prompt_logprobs_is_always_null(url):
    """vLLM sends prompt_logprobs: null on every completion choice and chat response."""
    completion = _post(url, "completions", {"prompt": "w3", "max_tokens": 1}).json()
    chat = _post(url, "chat/completions", {"messages": [{"role": "user", "content": "w3"}], "max_tokens": 1}).json()
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None


def test_an_echoed_token_id_prompt_keeps_its_special_tokens_as_text(client):
    """vLLM decodes an echoed prompt of ids with its special tokens (tokenizer.decode's default)."""
    prompt = [0, W["w3"], W["w4"]]  # <eos> first
    for logprobs in (None, 1):  # echoed alone, and scored (the engine's text)
        out = client.completions.create(
            model="backoff", prompt=prompt, max_tokens=1, echo=True, logprobs=logprobs, temperature=0
        )
        assert out.choices[0].text.startswith("<eos> w3 w4"), (logprobs, out.choices[0].text)
        if logprobs:
            assert out.choices[0].logprobs.tokens[:3] == ["<eos>", "w3", "w4"]


# -- 8: the Ingress's log line per request -------------------------------------------------------


def test_one_info_line_per_request_with_its_tokens_backoff_rate_and_latency(client):
    lines: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lines.append
    logger = logging.getLogger("ray.serve.backoff.requests")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        unary = client.completions.create(model="backoff", prompt="w3 w4", max_tokens=5, **GREEDY)
        chunks = list(
            client.chat.completions.create(
                model="backoff", messages=[{"role": "user", "content": "w3"}], max_tokens=3, n=2, stream=True, **GREEDY
            )
        )
    finally:
        logger.removeHandler(handler)
        logger.level = level
    assert [r.levelno for r in lines] == [logging.INFO] * 2
    first, second = (r.getMessage() for r in lines)
    assert first.startswith(f"request {unary.id}: 2 prompt + 5 generated tokens, backoff rate ")
    rate = unary.usage.model_extra["small_tokens"] / 5
    assert f"backoff rate {rate:.2f} (" in first and first.endswith(" ms")
    assert second.startswith(f"request {chunks[0].id}: ") and "6 generated tokens in 2 choices" in second
