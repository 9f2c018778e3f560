"""Data, teacher labels and the loss of the M_S distillation (scripts/distill_small.py).

Training windows come from the offline corpus (train split) and M_L's own chat answers;
M_L labels each window once with its final normed hidden states h_L (p_L = softmax(lm_head(h_L))
is recomputed when needed), so the student can revisit windows for several epochs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backoff_core.learning import corpus
from scripts.eval_small import chat_conversations, token_stream

# Share of training windows drawn from each source. Code dominates the stdlib bytes, but
# M_S mostly serves English chat, so prose and M_L's own answers are over-weighted.
SOURCE_WEIGHTS = {"stdlib_source": 0.35, "stdlib_docstrings": 0.2, "pydoc_topics": 0.15, "chat": 0.3}


def autocast(device: torch.device):
    # bf16 matmuls are ~3.5× faster than fp32 on our AVX512-BF16 CPUs and the teacher's
    # distribution moves by KL ≈ 3e-4 nats: negligible next to the student's error.
    return torch.autocast(device.type, dtype=torch.bfloat16)


def build_streams(large, tokenizer, args) -> dict[str, torch.Tensor]:
    """One long token stream per source (train split only): {source: [N]}."""
    streams = {
        source: token_stream(tokenizer, texts)
        for source, texts in tqdm(corpus.corpus_texts("train").items(), desc="tokenise", unit="source")
    }
    if args.chat_samples:
        # Half everyday, half Python questions, drawn with the run's seed.
        g = torch.Generator().manual_seed(args.seed)
        prompts = []
        for kind in ("general", "python"):
            pool = corpus.chat_prompts("train", kind)
            idx = torch.randperm(len(pool), generator=g)[: args.chat_samples // 2]
            prompts += [pool[i] for i in idx.tolist()]
        torch.manual_seed(args.seed)  # generate() samples from the global RNG
        convs = chat_conversations(
            large,
            tokenizer,
            prompts,
            args.chat_tokens,
            batch_size=16,
            do_sample=True,
            temperature=0.7,
            desc="M_L chat answers",
        )
        streams["chat"] = torch.tensor([t for ids, _ in convs for t in ids])
    return streams


def sample_windows(streams: dict[str, torch.Tensor], n: int, seq_len: int, g: torch.Generator) -> torch.Tensor:
    """Random windows, the source of each drawn by SOURCE_WEIGHTS: [n, T]."""
    names = [s for s in SOURCE_WEIGHTS if s in streams and len(streams[s]) > seq_len]
    weights = torch.tensor([SOURCE_WEIGHTS[s] for s in names])
    rows = []
    for src in torch.multinomial(weights, n, replacement=True, generator=g).tolist():
        stream = streams[names[src]]
        start = torch.randint(0, len(stream) - seq_len, (1,), generator=g).item()
        rows.append(stream[start : start + seq_len])
    return torch.stack(rows)


@torch.no_grad()
def teacher_hidden(large, x: torch.Tensor) -> torch.Tensor:
    """M_L's final *normed* hidden states h_L: [B, T, d]. p_L = softmax(lm_head(h_L))."""
    with autocast(x.device):
        return large.model(x).last_hidden_state.float()


def label_with_teacher(large, x: torch.Tensor, batch_size: int, desc: str) -> torch.Tensor:
    """M_L's final normed hidden states for every window, fp16 on the CPU: [n, T, d].

    Storing h_L (d = 576 numbers per position) instead of p_L (49152) makes the teacher's
    distributions cheap to keep (KL of the round trip ≈ 4e-7 nats). So the expensive
    30-layer pass runs once per window, and the student can revisit windows.
    """
    device = large.device
    return torch.cat(
        [
            teacher_hidden(large, x[i : i + batch_size].to(device)).half().cpu()
            for i in tqdm(range(0, len(x), batch_size), desc=desc, unit="batch")
        ]
    )


def keep_weights(logp_s: torch.Tensor, keep_weight: float, keep_entropy: float) -> torch.Tensor:
    """Per-position loss weights, mean 1: [P]. Positions where M_S's entropy is below
    ``keep_entropy`` nats (where an entropy router keeps the step on M_S, so M_S's token is
    the one committed) weigh ``1 + keep_weight`` against 1 elsewhere."""
    with torch.no_grad():
        entropy = -(logp_s.exp() * logp_s).sum(-1)  # [P]
        w = 1 + keep_weight * (entropy < keep_entropy).float()
        return w / w.mean()


def distill_loss(small, large, x: torch.Tensor, h_l: torch.Tensor, args, g: torch.Generator):
    """(total loss, mean KL(p_L‖p_S) per position) for x: [B, T], h_l: [B, T, d].

    The full-vocabulary KL dominates the step's cost (softmaxes over [B·T, 49152]), so it
    is taken at ``args.kl_positions`` random positions; the hidden-state term (cheap,
    d = 576) covers every position. Both aim at the same thing: with a shared norm and LM
    head, h_S = h_L implies p_S = p_L.
    """
    with autocast(x.device):
        h_s = small.model(x).last_hidden_state  # [B, T, d], normed by the shared norm
    h_s, h_l = h_s.float().flatten(0, 1), h_l.flatten(0, 1)  # [B*T, d]
    if 0 < args.kl_positions < len(h_s):
        pos = torch.randperm(len(h_s), generator=g)[: args.kl_positions].to(x.device)
        h_s_kl, h_l_kl = h_s[pos], h_l[pos]  # [P, d]
    else:
        h_s_kl, h_l_kl = h_s, h_l
    with autocast(x.device):
        logits_s = small.lm_head(h_s_kl)  # [P, V]
        with torch.no_grad():
            logits_l = large.lm_head(h_l_kl)  # [P, V]
    # log-softmax in fp32: the KL of close distributions is a small difference of big sums.
    logp_s = logits_s.float().log_softmax(-1)
    logp_l = logits_l.float().log_softmax(-1)
    kl_pos = F.kl_div(logp_s, logp_l, log_target=True, reduction="none").sum(-1)  # [P]
    kl = kl_pos.mean()
    loss = (kl_pos * keep_weights(logp_s, args.keep_weight, args.keep_entropy)).mean() if args.keep_weight else kl
    if args.hidden_weight:
        loss = loss + args.hidden_weight * (h_s - h_l).pow(2).mean() / h_l.pow(2).mean()
    return loss, kl


@torch.no_grad()
def heldout_kl(small, large, val: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Mean KL, share of positions with KL < 0.5 and top-1 agreement on the held-out monitor windows."""
    kls, agree = [], []
    for x, h_l in val:
        with autocast(x.device):
            logp_s = small(x).logits.float().log_softmax(-1)  # [b, T, V]
            logp_l = large.lm_head(h_l.float()).float().log_softmax(-1)
        kls.append(F.kl_div(logp_s, logp_l, log_target=True, reduction="none").sum(-1).flatten())
        agree.append((logp_s.argmax(-1) == logp_l.argmax(-1)).flatten())
    kl, agree = torch.cat(kls), torch.cat(agree)
    return {
        "kl_mean": kl.mean().item(),
        "kl_below_0.5": (kl < 0.5).float().mean().item(),
        "top1_agreement": agree.float().mean().item(),
    }
