"""Prompt logprobs on the default pair: always-large against transformers, batched against alone.

    PYTHONPATH=$PWD python -m benchmarks.prompt_scoring --copies 8 --routers always-large classifier always-small

Scores lm-eval-like requests (a shared context + 4 continuations, `max_tokens=0`,
`prompt_logprobs=0`) with `generate_many` (one batched prefill) and one at a time, and
prints the rates, the largest difference between the two, and the share of prompt positions
each router keeps on M_S (docs/prompt-logprobs.md has a run's figures).
"""

from __future__ import annotations

import argparse
import pydoc_data.topics
import time

import torch
from tqdm import tqdm

from backoff_core.engine.engine import BackoffEngine
from backoff_core.models.loading import load_chain
from backoff_core.types import GenerationRequest, RoutingParams, SamplingParams

CONTINUATIONS = (" the condition is true", " a loop runs forever", " it raises an error", " nothing happens at all")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8, help="copies of the 4 requests")
    parser.add_argument("--routers", nargs="+", default=["always-large", "classifier", "always-small"])
    args = parser.parse_args()
    chain = load_chain(None, None)
    engine, tok = BackoffEngine.from_chain(chain), chain.tokenizer
    context = tok.encode(" ".join(pydoc_data.topics.topics["if"].split())[:300])
    prompts = [tuple(context + tok.encode(c)) for c in CONTINUATIONS] * args.copies
    tokens = sum(len(p) for p in prompts)

    def requests(router: str) -> list[GenerationRequest]:
        sampling = SamplingParams(max_tokens=0, prompt_logprobs=0)
        return [GenerationRequest(p, sampling, RoutingParams(router=router)) for p in prompts]

    first = engine.generate(requests("always-large")[0])
    with torch.no_grad():
        expected = torch.log_softmax(chain.models[-1](torch.tensor([list(prompts[0])])).logits[0].float(), -1)
    diff = max(
        abs(e.chosen.logprob - float(expected[j, prompts[0][j + 1]])) for j, e in enumerate(first.prompt_logprobs[1:])
    )
    print(f"{len(prompts)} requests, {tokens} tokens; always-large vs transformers: max |diff| {diff:.2e}")
    for router in args.routers:
        reqs = requests(router)
        start = time.perf_counter()
        batched = engine.generate_many(reqs)
        t_batched = time.perf_counter() - start
        start = time.perf_counter()
        alone = [engine.generate(r) for r in tqdm(reqs, desc=f"{router}, one at a time")]
        t_alone = time.perf_counter() - start
        gap = max(
            abs(a.chosen.logprob - b.chosen.logprob)
            for x, y in zip(batched, alone)
            for a, b in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:])
        )
        sources = [s for r in batched for s in r.prompt_sources[1:]]
        print(
            f"{router}: batched {tokens / t_batched:.0f} tok/s, alone {tokens / t_alone:.0f} tok/s "
            f"(x{t_alone / t_batched:.2f}); max |batched - alone| {gap:.2e}; "
            f"share on M_S {sources.count(0) / len(sources):.2f}"
        )


if __name__ == "__main__":
    main()
