"""lm-evaluation-harness model type `backoff`: the batched engine in-process, no server.

    backoff lm-eval --model backoff --model_args router=entropy,threshold=5 --tasks ...

loglikelihood scores a continuation with the request's ROUTED teacher-forced distribution
(the engine's prompt logprobs): at each position the router, given M_S's state on the true
prefix, picks the model that scores the next token. always-large is exactly M_L, so it
equals lm-eval's `--model hf` on M_L (tests/backoff_core/evaluation/test_lm_model.py).
generate_until runs backoff decoding. Tokenisation and truncation follow HFLM's, so the two
see the same token ids.

lm-eval is an optional extra (`pip install '.[eval]'`): this module imports it at the top and
nothing in backoff_core imports this module except the commands that run lm-eval.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from backoff_core.evaluation.frontier_spec import DEFAULT_ROUTING
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Usage:
    """Which model produced what, over everything this LM ran (the backoff rate's counts).
    scored: continuation positions of loglikelihood requests (the model that scored each);
    generated: tokens of generate_until. Index = level (0 = M_S)."""

    scored: list[int] = field(default_factory=lambda: [0, 0])
    generated: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, counts: list[int], sources: Sequence[int | None]) -> None:
        for s in sources:
            if s is None:
                continue
            while len(counts) <= s:
                counts.append(0)
            counts[s] += 1

    def backoff_rate(self) -> float:
        """Share of all scored positions and generated tokens on M_S (level 0)."""
        total = sum(self.scored) + sum(self.generated)
        return (self.scored[0] + self.generated[0]) / total if total else 0.0


def parse_thresholds(value) -> tuple[float, ...] | None:
    """model_args' threshold: one number, or one per boundary joined by ':' (lm-eval splits
    model_args on ',')."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return (float(value),)
    return tuple(float(x) for x in str(value).split(":"))


@register_model("backoff")
class BackoffLM(TemplateLM):
    """model_args: small, large (none: the embedded default pair), router, threshold, rate,
    target_backoff, classifier (router head dir), device, dtype, quantize_small / quantize_large
    (none or fp8: docs/fp8.md), batch_size (requests the engine steps together), seed (of
    sampled generations), max_length (default: the pair's context window). `engine=`
    (create_from_arg_obj / Python) reuses an engine already loaded."""

    def __init__(
        self,
        small: str | None = None,
        large: str | None = None,
        router: str = DEFAULT_ROUTING.router,
        threshold=None,
        rate: float | None = None,
        target_backoff: float | None = None,
        classifier: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        quantize_small: str = "none",
        quantize_large: str = "none",
        batch_size: int | str = 32,
        seed: int = 1234,
        max_length: int | None = None,
        engine=None,
        **_unused,  # lm-eval passes batch_size/max_batch_size/device "additional config"
    ) -> None:
        super().__init__()
        if engine is None:
            import torch

            from backoff_core.engine.engine import BackoffEngine
            from backoff_core.models.loading import LoadSpec, load_chain

            if str(device).startswith("cuda") and not torch.cuda.is_available():
                # lm-eval's CLI asks for cuda:0 unless told otherwise; HFLM then runs on the CPU too
                log.warning("device %s asked for, but no CUDA device is available: running on the CPU", device)
                device = "cpu"
            spec = LoadSpec(device or "cpu", dtype, quantize_small=quantize_small, quantize_large=quantize_large)
            chain = load_chain(small, large, spec=spec)
            engine = BackoffEngine.from_chain(chain, classifier_path=classifier)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        thresholds = parse_thresholds(threshold)
        if thresholds is None and router == DEFAULT_ROUTING.router and rate is None and target_backoff is None:
            thresholds = DEFAULT_ROUTING.thresholds  # the packaged default routing (serve config)
        self.routing = RoutingParams(
            router=router,
            thresholds=thresholds,
            rate=None if rate in (None, "") else float(rate),
            target_backoff=None if target_backoff in (None, "") else float(target_backoff),
        )
        self.batch = 32 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        self.seed = int(seed)
        self._max_length = int(max_length) if max_length else None
        self.usage = Usage()

    # -- what lm-eval asks of a TemplateLM -------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as HFLM: BOS if the tokenizer has one, else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.engine.context_window or 2048

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "backoff").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # HFLM's rule (add_bos_token unset): the tokenizer's own default, unless the string
        # already starts with the BOS text
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            extra["add_special_tokens"] = False
        return self.tokenizer.encode(string, **extra)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # -- loglikelihood -----------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context ids, continuation ids). One
        engine request per pair: prompt = context + continuation, max_tokens 0, routed prompt
        logprobs of the continuation's positions alone (the context is a plain prefill), summed."""
        # longest first (as HFLM), so a batch's sequences have similar lengths
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="backoff loglikelihood", disable=disable_tqdm)
        for start in range(0, len(order), self.batch):
            chunk = order[start : start + self.batch]
            batch = []
            for i in chunk:
                _, context, continuation = requests[i]
                if not continuation:
                    raise ValueError("loglikelihood of an empty continuation")
                # HFLM feeds (context + continuation)[-(max_length + 1):][:-1]; the engine
                # feeds the whole prompt, so the window holds max_length tokens of it
                ids = (list(context) + list(continuation))[-self.max_length :]
                first = len(ids) - min(len(continuation), len(ids) - 1)  # the continuation's first position
                sampling = SamplingParams(max_tokens=0, prompt_logprobs=1, prompt_logprobs_from=first)
                batch.append(GenerationRequest(tuple(ids), sampling, self.routing))
            results = self.engine.generate_many(batch)
            for i, request, result in zip(chunk, batch, results):
                n = min(len(requests[i][2]), len(request.prompt_ids) - 1)
                scored = result.prompt_logprobs[-n:]
                logprob = sum(t.chosen.logprob for t in scored)
                greedy = all(t.top[0].token_id == t.chosen.token_id for t in scored)
                self.usage.add(self.usage.scored, result.prompt_sources[-n:])
                out[i] = (float(logprob), bool(greedy))
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
            bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole string's log-likelihood in disjoint windows of max_length (as HFLM)."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, scores):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generate_until ----------------------------------------------------------------------
    def _sampling(self, gen_kwargs: dict, index: int) -> tuple[SamplingParams, list[str]]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None), eos=self.tok_decode([self.eot_token_id]) or None)
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        sampling = SamplingParams(
            max_tokens=int(kwargs["max_gen_toks"]),
            temperature=temperature,
            top_p=float(kwargs.get("top_p") or 1.0),
            top_k=int(kwargs.get("top_k") or 0),
            seed=self.seed + index,
            stop=tuple(s for s in until if s),
        )
        return sampling, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        jobs = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            sampling, until = self._sampling(gen_kwargs, i)
            # leave room for the generation, keeping the context's end (HFLM's left truncation)
            room = self.max_length - sampling.max_tokens
            if room < 1:
                raise ValueError(f"max_gen_toks {sampling.max_tokens} leaves no room in {self.max_length} tokens")
            ids = self.tok_encode(context)[-room:] or [self.prefix_token_id]
            jobs.append((i, GenerationRequest(tuple(ids), sampling, self.routing), until))
        jobs.sort(key=lambda job: -len(job[1].prompt_ids))
        bar = tqdm(total=len(jobs), desc="backoff generate_until", disable=disable_tqdm)
        for start in range(0, len(jobs), self.batch):
            chunk = jobs[start : start + self.batch]
            results = self.engine.generate_many([request for _, request, _ in chunk])
            for (i, _, until), result in zip(chunk, results):
                text = postprocess_generated_text(generation=result.text, stop=until, think_end_token=None)
                self.usage.add(self.usage.generated, result.sources)
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(chunk))
        bar.close()
        return out  # type: ignore[return-value]
