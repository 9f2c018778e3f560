"""The learned decision function's head: an MLP over one hidden layer of M_S.

Checkpoint = `head.safetensors` (weights) + `head.json` (metadata: layer, objective, sizes,
pair, calibration table). Objectives and the score each gives (higher = needs M_L):
- binary: the paper's balanced classifier on KL > T_KL; score = P(high KL)
- regression: predicts log KL; score = predicted log KL
- buckets: classes over KL buckets; score = expected KL bucket index
A head may also read summaries of M_S's own next-token distribution (`features`, e.g.
entropy and top probability), computed from the logits the step already has.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

OBJECTIVES = ("binary", "regression", "buckets")
LOGIT_FEATURES = ("entropy", "max_prob")


def logit_features(logits: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
    """[B, V] M_S logits -> [B, len(names)] (same definitions as router-data's ent_s / maxp_s)."""
    log_p = torch.log_softmax(logits.float(), -1)
    cols = [-(log_p.exp() * log_p).sum(-1) if n == "entropy" else log_p.amax(-1).exp() for n in names]
    return torch.stack(cols, -1)


@dataclass(frozen=True)
class HeadMeta:
    hidden_size: int
    layer: int
    objective: str = "binary"
    inner_size: int = 1024
    num_classes: int = 2
    pair: str = ""
    # backoff rate -> threshold, filled by calibration: [[rate, threshold], ...]
    calibration: tuple[tuple[float, float], ...] = ()
    extra: dict = field(default_factory=dict)
    features: tuple[str, ...] = ()  # LOGIT_FEATURES appended to the hidden state

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {self.objective!r}; choose one of {OBJECTIVES}")
        unknown = set(self.features) - set(LOGIT_FEATURES)
        if unknown:
            raise ValueError(f"unknown head feature(s) {sorted(unknown)}; choose from {LOGIT_FEATURES}")


class ClassifierHead(nn.Module):
    def __init__(self, meta: HeadMeta) -> None:
        super().__init__()
        self.meta = meta
        out = 1 if meta.objective == "regression" else meta.num_classes
        self.mlp = nn.Sequential(
            nn.Linear(meta.hidden_size + len(meta.features), meta.inner_size),
            nn.GELU(),
            nn.Linear(meta.inner_size, out),
        )

    @property
    def layer(self) -> int:
        return self.meta.layer

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [B, d] (+ logits: [B, V] when the head has features) -> [B, out]."""
        x = hidden.to(self.mlp[0].weight.dtype)
        if self.meta.features:
            if logits is None:
                raise ValueError(f"this router head reads M_S's logits too ({', '.join(self.meta.features)})")
            x = torch.cat([x, logit_features(logits, self.meta.features).to(x.dtype)], -1)
        return self.mlp(x)

    def score(self, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:  # [B, d] -> [B]
        out = self(hidden, logits)
        if self.meta.objective == "regression":
            return out[:, 0]
        probs = torch.softmax(out, -1)
        if self.meta.objective == "binary":
            return probs[:, 1]
        return (probs * torch.arange(out.shape[-1], device=out.device)).sum(-1)

    def threshold_for_rate(self, backoff_rate: float) -> float:
        """Interpolate the calibration table (needs calibration)."""
        table = sorted(self.meta.calibration)
        if not table:
            raise ValueError("this router head has no calibration table; run `backoff router-calibrate`")
        rates = torch.tensor([r for r, _ in table])
        thresholds = torch.tensor([t for _, t in table])
        i = int(torch.searchsorted(rates, torch.tensor(backoff_rate)).clamp(1, len(table) - 1))
        r0, r1, t0, t1 = rates[i - 1], rates[i], thresholds[i - 1], thresholds[i]
        w = 0.0 if r1 == r0 else float((backoff_rate - r0) / (r1 - r0))
        return float(t0 + min(max(w, 0.0), 1.0) * (t1 - t0))

    def default_thresholds(self, num_levels: int) -> tuple[float, ...]:
        if self.meta.calibration:
            return tuple(self.threshold_for_rate(0.5 + 0.4 * i / max(1, num_levels - 1)) for i in range(num_levels - 1))
        return tuple(0.5 for _ in range(num_levels - 1))

    # -- persistence ----------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, directory / "head.safetensors")
        (directory / "head.json").write_text(json.dumps(asdict(self.meta), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "ClassifierHead":
        directory = Path(directory)
        meta_file = directory / "head.json"
        if not meta_file.exists():
            raise FileNotFoundError(f"no router head at {directory} (expected head.json + head.safetensors)")
        raw = json.loads(meta_file.read_text())
        raw["calibration"] = tuple(tuple(x) for x in raw.get("calibration", ()))
        raw["features"] = tuple(raw.get("features", ()))
        head = cls(HeadMeta(**raw))
        head.load_state_dict(load_file(directory / "head.safetensors"))
        return head.eval()

    @classmethod
    def random(cls, hidden_size: int, layer: int = -1, seed: int = 0) -> "ClassifierHead":
        """An untrained head (tests): deterministic weights from `seed`."""
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return cls(HeadMeta(hidden_size=hidden_size, layer=layer, inner_size=64)).eval()
