"""Test helpers: engines over tiny models and a backend that records every extend."""

from __future__ import annotations

import torch

from backoff_core.engine.engine import BackoffEngine
from backoff_core.runners.dynamic import ModelRunner
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams


def engine_for(models, tokenizer, **kwargs) -> BackoffEngine:
    names = ["small", *[f"medium{i}" for i in range(1, len(models) - 1)], "large"]
    return BackoffEngine([ModelRunner(m, n) for m, n in zip(models, names)], tokenizer, **kwargs)


def request(prompt, max_tokens=16, router="always-small", seed=None, temperature=0.0, **routing) -> GenerationRequest:
    return GenerationRequest(
        tuple(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True),
        RoutingParams(router=router, **routing),
    )


def hf_greedy(model, prompt, n) -> tuple[int, ...]:
    out = model.generate(
        torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return tuple(out[0, len(prompt) :].tolist())


def penalized_greedy(model, prompt, n, presence=0.0, frequency=0.0, repetition=1.0) -> tuple[int, ...]:
    """Greedy decoding with vLLM's penalties, by hand over plain transformers: repetition (HF's,
    over prompt and generated tokens) on the raw logits, then -presence and -frequency x count
    over the generated ones."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
            seen = torch.tensor(sorted(set(ids)), device=model.device)
            x = logits[seen]
            # by a tensor, as the engine: CUDA divides by a Python scalar as x * (1 / p), an ulp off
            p = torch.tensor(repetition, device=model.device)
            logits[seen] = torch.where(x > 0, x / p, x * p)
            for t in set(ids[len(prompt) :]):
                logits[t] -= presence + frequency * ids[len(prompt) :].count(t)
            ids.append(int(logits.argmax()))
    return tuple(ids[len(prompt) :])


class Recording(ModelRunner):
    """A ModelRunner that keeps (session, tokens before, new ids, logits) of every extend."""

    def __init__(self, model, name):
        super().__init__(model, name)
        self.calls: list[tuple[str, int, list[int], torch.Tensor]] = []

    def extend(self, items, hidden_layer=None, last_only=False):
        before = {request_id: self.length(request_id) for request_id, _ in items}
        out = super().extend(items, hidden_layer, last_only)
        for (request_id, ids), ext in zip(items, out):
            self.calls.append((request_id, before[request_id], list(ids), ext.logits))
        return out
