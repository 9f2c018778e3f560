"""`backoff router-train`: fit a ClassifierHead over one hidden layer of M_S to router data.

Objectives (router_head.OBJECTIVES), all trained on the same features:
- binary: the paper's classifier. Label = KL > T_KL, T_KL at a percentile of the pretraining
  KL (75th in the paper); classes balanced by resampling the majority class every epoch.
- regression: log(KL + ε) with MSE, so the head knows *how* far apart the models are
  (the paper's own suggestion after its Figure 3).
- buckets: classes over KL buckets (edges at percentiles), cross-entropy.
Two stages: pretrain on one corpus, then finetune on a second (lower rate). The epoch kept
is the one whose routing is best on held-out windows of the stage's data (area under the
teacher-forced NLL-vs-backoff curve, router_metrics), not the one with the lowest loss.
Inputs are standardised with pretraining statistics, folded into the first layer on save,
so the checkpoint is a plain ClassifierHead.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from backoff_core.learning.data import RouterData
from backoff_core.learning.metrics import quality
from backoff_core.routing.head import OBJECTIVES, ClassifierHead, HeadMeta

LOG_EPS = 1e-3  # regression target log(KL + ε): KL is clamped at 0


@dataclass(frozen=True)
class TrainConfig:
    layer: int = -1  # -1: M_S's last hidden state
    objective: str = "binary"
    inner_size: int = 512
    percentile: float = 75.0  # T_KL of the binary objective
    bucket_percentiles: tuple[float, ...] = (50.0, 75.0, 90.0, 97.0)
    epochs: int = 20
    finetune_epochs: int = 10
    lr: float = 1e-3
    finetune_lr: float = 3e-4
    weight_decay: float = 0.01
    batch_size: int = 256
    input_dropout: float = 0.1
    val_fraction: float = 0.1
    features: tuple[str, ...] = ()  # M_S-logit features next to the hidden state (router_head.LOGIT_FEATURES)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose one of {OBJECTIVES}")
        if not 0 < self.percentile < 100:
            raise ValueError(f"percentile must be in (0, 100), got {self.percentile}")


@dataclass(frozen=True)
class Labels:
    """Label statistics from the pretraining data (kept fixed for finetuning)."""

    t_kl: float
    bucket_edges: tuple[float, ...]
    mean: torch.Tensor  # [d] feature standardisation
    std: torch.Tensor  # [d]


def make_labels(cfg: TrainConfig, data: RouterData, layer: int) -> Labels:
    kl = data.kl.double()
    x = data.inputs(layer, cfg.features)
    edges = tuple(float(torch.quantile(kl, p / 100)) for p in cfg.bucket_percentiles)
    return Labels(float(torch.quantile(kl, cfg.percentile / 100)), edges, x.mean(0), x.std(0).clamp_min(1e-4))


def targets(objective: str, kl: torch.Tensor, labels: Labels) -> torch.Tensor:
    if objective == "binary":
        return (kl > labels.t_kl).long()
    if objective == "regression":
        return torch.log(kl.float() + LOG_EPS)
    return torch.bucketize(kl.float(), torch.tensor(labels.bucket_edges, dtype=torch.float32)).long()


def loss_fn(objective: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if objective == "regression":
        return F.mse_loss(out[:, 0], y)
    return F.cross_entropy(out, y)


def _epoch_indices(objective: str, y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """This epoch's sample order; binary: all positives + as many resampled negatives."""
    if objective != "binary":
        return torch.randperm(len(y), generator=g)
    pos, neg = torch.nonzero(y == 1)[:, 0], torch.nonzero(y == 0)[:, 0]
    few, many = (pos, neg) if len(pos) <= len(neg) else (neg, pos)
    many = many[torch.randperm(len(many), generator=g)[: len(few)]]
    both = torch.cat([few, many])
    return both[torch.randperm(len(both), generator=g)]


def _evaluate(head: ClassifierHead, x: torch.Tensor, data: RouterData, labels: Labels, objective: str) -> dict:
    head.eval()
    with torch.no_grad():
        out = torch.cat([head.mlp(x[i : i + 4096]) for i in range(0, len(x), 4096)])
        loss = float(loss_fn(objective, out, targets(objective, data.kl, labels)))
        score = _score(head, out)
    q = quality(score, data.kl, data.nll_s, data.nll_l, labels.t_kl)
    return {"loss": loss, "area": q.area, "gap_closed": q.gap_closed, "auc_high_kl": q.auc_high_kl}


@torch.no_grad()
def data_scores(head: ClassifierHead, data: RouterData, batch: int = 8192) -> torch.Tensor:
    """[N] the score the engine would compute at each stored position (fp16 hidden states)."""
    x = data.inputs(head.layer, head.meta.features)
    return torch.cat([_score(head, head.mlp(x[i : i + batch])) for i in range(0, len(x), batch)]).float()


def _score(head: ClassifierHead, out: torch.Tensor) -> torch.Tensor:
    if head.meta.objective == "regression":
        return out[:, 0]
    probs = torch.softmax(out, -1)
    if head.meta.objective == "binary":
        return probs[:, 1]
    return (probs * torch.arange(out.shape[-1])).sum(-1)


def _stage(
    head, data: RouterData, labels: Labels, cfg: TrainConfig, epochs: int, lr: float, name: str, log: list
) -> None:
    """Train on `data` (minus held-out windows); keep the epoch with the best held-out area."""
    train, val = data.split(cfg.val_fraction, cfg.seed)
    norm = lambda d: (d.inputs(head.meta.layer, cfg.features) - labels.mean) / labels.std  # noqa: E731
    x, xv = norm(train), norm(val)
    y = targets(cfg.objective, train.kl, labels)
    g = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    steps = max(1, epochs * math.ceil(len(_epoch_indices(cfg.objective, y, g)) / cfg.batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    best, best_state = _evaluate(head, xv, val, labels, cfg.objective), copy.deepcopy(head.state_dict())
    log.append({"stage": name, "epoch": 0, "train_loss": None, **best})
    for epoch in tqdm(range(1, epochs + 1), desc=f"router-train {name}", unit="epoch"):
        head.train()
        idx = _epoch_indices(cfg.objective, y, g)
        total = 0.0
        for b in range(0, len(idx), cfg.batch_size):
            i = idx[b : b + cfg.batch_size]
            xb = F.dropout(x[i], cfg.input_dropout, training=True)
            loss = loss_fn(cfg.objective, head.mlp(xb), y[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched.last_epoch < steps - 1:
                sched.step()
            total += float(loss.detach()) * len(i)
        metrics = _evaluate(head, xv, val, labels, cfg.objective)
        log.append({"stage": name, "epoch": epoch, "train_loss": total / len(idx), **metrics})
        if metrics["area"] < best["area"]:
            best, best_state = metrics, copy.deepcopy(head.state_dict())
    head.load_state_dict(best_state)


def train(
    cfg: TrainConfig, pretrain: RouterData, finetune: RouterData | None = None, meta_extra: dict | None = None
) -> tuple[ClassifierHead, list[dict]]:
    """-> (head with standardisation folded in, per-epoch log)."""
    torch.manual_seed(cfg.seed)
    num_layers = max(pretrain.hidden)
    layer = num_layers if cfg.layer == -1 else cfg.layer
    labels = make_labels(cfg, pretrain, layer)
    classes = {"binary": 2, "regression": 1, "buckets": len(labels.bucket_edges) + 1}[cfg.objective]
    extra = {
        "t_kl": labels.t_kl,
        "percentile": cfg.percentile,
        "bucket_edges": list(labels.bucket_edges),
        "log_eps": LOG_EPS,
        "train_config": _jsonable(asdict(cfg)),
        **(meta_extra or {}),
    }
    meta = HeadMeta(
        hidden_size=pretrain.hidden[layer].shape[1],
        layer=layer,
        objective=cfg.objective,
        inner_size=cfg.inner_size,
        num_classes=max(2, classes),
        features=tuple(cfg.features),
        pair="+".join(pretrain.pair.get("names", [])),
        extra=extra,
    )
    head = ClassifierHead(meta)
    log: list[dict] = []
    start = time.perf_counter()
    _stage(head, pretrain, labels, cfg, cfg.epochs, cfg.lr, "pretrain", log)
    if finetune is not None and cfg.finetune_epochs > 0:
        _stage(head, finetune, labels, cfg, cfg.finetune_epochs, cfg.finetune_lr, "finetune", log)
    fold_standardisation(head, labels.mean, labels.std)
    stage = "finetune" if finetune is not None and cfg.finetune_epochs > 0 else "pretrain"
    head.meta.extra.update(
        train_seconds=time.perf_counter() - start,
        val=_best(log, stage),
        small_fingerprint=pretrain.pair.get("small_fingerprint", ""),
    )
    return head.eval(), log


def _best(log: list[dict], stage: str) -> dict | None:
    rows = [r for r in log if r["stage"] == stage]
    return min(rows, key=lambda r: r["area"]) if rows else None


def fold_standardisation(head: ClassifierHead, mean: torch.Tensor, std: torch.Tensor) -> None:
    """W((x - μ)/σ) + b = (W/σ) x + (b - (W/σ) μ): the saved head reads raw hidden states."""
    first = head.mlp[0]
    with torch.no_grad():
        w = first.weight / std[None, :]
        first.bias.sub_(w @ mean)
        first.weight.copy_(w)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def save(head: ClassifierHead, log: list[dict], out: str | Path) -> Path:
    """head.safetensors + head.json + train_log.json + train_curve.png under `out`."""
    out = Path(out)
    head.save(out)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    from backoff_core.learning.plots import plot_training

    plot_training(log, out / "train_curve.png")
    return out
