"""`backoff router-data`: what the router learns from, one teacher-forced pass per window.

M_S and M_L read the same token windows (batched; every position in parallel). Per router
position t (the step that picks token t+1) a shard stores:
  hidden.{n}  [N, d] fp16  M_S hidden state after layer n (0 = embeddings), what a head reads
  kl          [N]          KL(M_L ‖ M_S) of the next-token distributions (the oracle's score)
  ent_s/ent_l [N]          entropies (nats); maxp_s [N]: M_S's top probability
  nll_s/nll_l [N]          -log p(token t+1) under each model (the quality of a routing)
  agree       [N] uint8    argmax_S == argmax_L
  window/pos/domain/token  [N] int32  where the position comes from, and the next token
  doc         [N] int32    the document the window was cut from (windows of one document are
                           resampled together by the evaluation's bootstrap; older data has
                           none and reads as one document per window)
Shards are safetensors files listed in manifest.json; a rerun skips finished shards.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from backoff_core.learning.sources import ChatGen, Document, load_documents
from backoff_core.models.kernels import model_fingerprint
from backoff_core.sampling import argmax_last, entropy, kl_divergence

FIELDS = ("kl", "ent_s", "ent_l", "maxp_s", "nll_s", "nll_l", "agree", "window", "pos", "domain", "token", "doc")


@dataclass(frozen=True)
class DataConfig:
    corpora: tuple[str, ...]
    seq_len: int = 256
    max_positions: int = 16384  # split evenly over the corpora
    windows_per_doc: int = 2  # chunks of one long document, at most (spreads the text)
    min_positions: int = 16  # shorter windows are dropped
    layers: tuple[int, ...] | None = None  # None: every hidden state of M_S (0..num_layers)
    batch_size: int = 4
    shard_windows: int = 32
    seed: int = 0
    chat: ChatGen = field(default_factory=ChatGen)


@dataclass(frozen=True)
class Window:
    ids: tuple[int, ...]
    start: int  # first router position
    domain: int  # index into DataConfig.corpora
    doc: int = 0  # the document it was cut from (numbered over all corpora)

    @property
    def positions(self) -> int:
        return len(self.ids) - 1 - self.start


def pair_info(chain) -> dict:
    small = chain.models[0]
    return {
        "names": list(chain.names),
        "small_fingerprint": model_fingerprint(small),
        "hidden_size": int(small.config.hidden_size),
        "small_layers": int(small.config.num_hidden_layers),
    }


def _doc_windows(doc: Document, cfg: DataConfig, rng: random.Random) -> list[tuple[tuple[int, ...], int]]:
    if doc.start > 0:  # a conversation: one window from its start, router positions = the answer
        ids = doc.ids[: cfg.seq_len]
        return [(ids, doc.start)] if len(ids) - 1 - doc.start >= cfg.min_positions else []
    chunks = [doc.ids[i : i + cfg.seq_len] for i in range(0, len(doc.ids), cfg.seq_len)]
    chunks = [c for c in chunks if len(c) - 1 >= cfg.min_positions]
    return [(c, 0) for c in rng.sample(chunks, min(cfg.windows_per_doc, len(chunks)))]


def make_windows(docs: list[list[Document]], cfg: DataConfig) -> list[Window]:
    """Seeded choice of windows, max_positions / len(corpora) positions per corpus."""
    budget = cfg.max_positions // len(docs)
    windows: list[Window] = []
    first_doc = 0
    for domain, corpus_docs in enumerate(docs):
        rng = random.Random(f"{cfg.seed}:{cfg.corpora[domain]}")
        pool = [
            Window(ids, start, domain, first_doc + i)
            for i, d in enumerate(corpus_docs)
            for ids, start in _doc_windows(d, cfg, rng)
        ]
        first_doc += len(corpus_docs)
        rng.shuffle(pool)
        taken = 0
        for w in pool:
            if taken >= budget:
                break
            windows.append(w)
            taken += w.positions
    return windows


@torch.inference_mode()
def teacher_forced(
    small, large, windows: list[Window], layers: tuple[int, ...], batch_size: int, first_window: int = 0
) -> dict[str, torch.Tensor]:
    """The per-position record (module docstring) of `windows`, batched by length."""
    device = next(small.parameters()).device
    order = sorted(range(len(windows)), key=lambda i: len(windows[i].ids))
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(windows[i].ids) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)  # [B, T] right-padded
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            ids[row, : len(windows[i].ids)] = torch.tensor(windows[i].ids)
            mask[row, : len(windows[i].ids)] = 1
        ids, mask = ids.to(device), mask.to(device)
        out_s = small(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        logits_l = large(input_ids=ids, attention_mask=mask).logits
        for row, i in enumerate(idx):
            w = windows[i]
            p = torch.arange(w.start, len(w.ids) - 1, device=device)  # [N] router positions
            parts[i] = _positions(
                out_s.logits[row, p],
                logits_l[row, p],
                ids[row, p + 1],
                {n: out_s.hidden_states[n][row, p] for n in layers},
            )
            parts[i].update(
                window=torch.full((len(p),), first_window + i, dtype=torch.int32),
                pos=p.int().cpu(),
                domain=torch.full((len(p),), w.domain, dtype=torch.int32),
                doc=torch.full((len(p),), w.doc, dtype=torch.int32),
            )
    keys = parts[0].keys() if parts else ()
    return {k: torch.cat([parts[i][k] for i in range(len(windows))]) for k in keys}


def _positions(logits_s, logits_l, targets, hidden: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    # logits_*: [N, V]; targets: [N]; hidden: layer -> [N, d]
    logp_s = torch.log_softmax(logits_s.float(), -1)
    logp_l = torch.log_softmax(logits_l.float(), -1)
    out = {
        "kl": kl_divergence(logits_l, logits_s),
        "ent_s": entropy(logits_s),
        "ent_l": entropy(logits_l),
        "maxp_s": logp_s.amax(-1).exp(),
        "nll_s": -logp_s.gather(-1, targets[:, None])[:, 0],
        "nll_l": -logp_l.gather(-1, targets[:, None])[:, 0],
        "agree": (argmax_last(logits_s.float()) == argmax_last(logits_l.float())).to(torch.uint8),
        "token": targets.int(),
    }
    out = {k: v.cpu() for k, v in out.items()}
    out.update({f"hidden.{n}": h.half().cpu().contiguous() for n, h in hidden.items()})
    return out


def _config_json(cfg: DataConfig) -> dict:
    d = asdict(cfg)
    d["corpora"] = list(cfg.corpora)
    d["layers"] = list(cfg.layers) if cfg.layers is not None else None
    return d


def build(chain, cfg: DataConfig, out: str | Path) -> Path:
    """Write shards + manifest.json under `out`; finished shards of the same config are kept."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    small, large = chain.models[0], chain.models[-1]
    layers = cfg.layers if cfg.layers is not None else tuple(range(small.config.num_hidden_layers + 1))
    if any(not 0 <= n <= small.config.num_hidden_layers for n in layers):
        raise ValueError(f"layers must be in 0..{small.config.num_hidden_layers} for this M_S, got {layers}")
    manifest_path = out / "manifest.json"
    manifest = {"config": _config_json(cfg), "pair": pair_info(chain), "layers": list(layers), "shards": []}
    if manifest_path.exists():
        old = json.loads(manifest_path.read_text())
        if old["config"] != manifest["config"] or old["pair"] != manifest["pair"]:
            raise ValueError(f"{out} holds router data of another config or pair; choose another --out")
        manifest = old
    docs = [load_documents(spec, chain.tokenizer, out, large, cfg.chat) for spec in cfg.corpora]
    windows = make_windows(docs, cfg)
    if not windows:
        raise ValueError(f"no window of >= {cfg.min_positions} positions in {cfg.corpora}")
    done = {s["file"] for s in manifest["shards"] if (out / s["file"]).exists()}
    manifest["shards"] = [s for s in manifest["shards"] if s["file"] in done]
    starts = range(0, len(windows), cfg.shard_windows)
    for shard, lo in enumerate(tqdm(starts, desc=f"router-data {out.name}", unit="shard")):
        name = f"shard-{shard:05d}.safetensors"
        if name in done:
            continue
        chunk = windows[lo : lo + cfg.shard_windows]
        tensors = teacher_forced(small, large, chunk, layers, cfg.batch_size, first_window=lo)
        save_file(tensors, str(out / (name + ".tmp")))
        (out / (name + ".tmp")).rename(out / name)  # a killed run never leaves half a shard
        manifest["shards"].append({"file": name, "windows": [lo, lo + len(chunk)], "positions": len(tensors["kl"])})
        _write_manifest(manifest_path, manifest, complete=False)
    manifest["windows"] = len(windows)
    manifest["positions"] = sum(s["positions"] for s in manifest["shards"])
    manifest["domains"] = list(cfg.corpora)
    _write_manifest(manifest_path, manifest, complete=True)
    return manifest_path


def _write_manifest(path: Path, manifest: dict, complete: bool) -> None:
    manifest["complete"] = complete
    manifest["shards"].sort(key=lambda s: s["file"])
    path.with_suffix(".tmp").write_text(json.dumps(manifest, indent=2))
    path.with_suffix(".tmp").rename(path)


@dataclass
class RouterData:
    """Every position of one or more router-data dirs, concatenated (CPU tensors)."""

    fields: dict[str, torch.Tensor]  # FIELDS -> [N]
    hidden: dict[int, torch.Tensor]  # layer -> [N, d] fp16
    domains: list[str]  # domain index -> name (dir-qualified when several dirs)
    pair: dict

    def __len__(self) -> int:
        return len(self.fields["kl"])

    def __getattr__(self, name: str) -> torch.Tensor:
        if name in FIELDS:
            return self.fields[name]
        raise AttributeError(name)

    def features(self, layers: int | tuple[int, ...]) -> torch.Tensor:
        """[N, d * len(layers)] float32: the head's input."""
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        missing = [n for n in layers if n not in self.hidden]
        if missing:
            raise ValueError(f"layer(s) {missing} not stored; this data has layers {sorted(self.hidden)}")
        return torch.cat([self.hidden[n].float() for n in layers], -1)

    def inputs(self, layers: int | tuple[int, ...], logit_features: tuple[str, ...] = ()) -> torch.Tensor:
        """[N, d (+ F)] float32: what a head reads, hidden state(s) then M_S-logit features
        (router_head.LOGIT_FEATURES; the stored ent_s / maxp_s are the same quantities)."""
        x = self.features(layers)
        if logit_features:
            stored = {"entropy": self.ent_s, "max_prob": self.maxp_s}
            x = torch.cat([x, torch.stack([stored[n].float() for n in logit_features], -1)], -1)
        return x

    def subset(self, mask: torch.Tensor) -> "RouterData":
        return RouterData(
            {k: v[mask] for k, v in self.fields.items()},
            {n: h[mask] for n, h in self.hidden.items()},
            self.domains,
            self.pair,
        )

    def split(self, val_fraction: float, seed: int) -> tuple["RouterData", "RouterData"]:
        """(train, val) by whole windows, so no window feeds both."""
        windows = torch.unique(self.window)
        g = torch.Generator().manual_seed(seed)
        val = windows[torch.randperm(len(windows), generator=g)[: max(1, int(len(windows) * val_fraction))]]
        is_val = torch.isin(self.window, val)
        return self.subset(~is_val), self.subset(is_val)


def load(dirs: str | Path | list) -> RouterData:
    """Concatenate complete router-data dirs (same pair and layers)."""
    dirs = [Path(d) for d in ([dirs] if isinstance(dirs, (str, Path)) else dirs)]
    fields: dict[str, list] = {k: [] for k in FIELDS}
    hidden: dict[int, list] = {}
    domains: list[str] = []
    pair = None
    window_base, doc_base = 0, 0
    for d in dirs:
        path = d / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"no router data at {d} (run `backoff router-data --out {d}` first)")
        manifest = json.loads(path.read_text())
        if not manifest.get("complete"):
            raise ValueError(f"router data at {d} is incomplete; rerun `backoff router-data` to finish it")
        if pair is not None and manifest["pair"]["small_fingerprint"] != pair["small_fingerprint"]:
            raise ValueError(f"{d} was made with another M_S than {dirs[0]}")
        if hidden and sorted(hidden) != sorted(manifest["layers"]):
            raise ValueError(f"{d} stores layers {manifest['layers']}, {dirs[0]} stores {sorted(hidden)}")
        pair = manifest["pair"]
        prefix = f"{d.name}/" if len(dirs) > 1 else ""
        for shard in manifest["shards"]:
            t = load_file(str(d / shard["file"]))
            docs = t["doc"] if "doc" in t else t["window"]  # older data: a document per window
            for k in FIELDS:
                v = docs if k == "doc" else t[k]
                if k == "domain":
                    v = v + len(domains)
                elif k == "window":
                    v = v + window_base
                elif k == "doc":
                    v = v + doc_base
                fields[k].append(v)
            for key in (k for k in t if k.startswith("hidden.")):
                hidden.setdefault(int(key.split(".")[1]), []).append(t[key])
        domains += [prefix + c for c in manifest["domains"]]
        window_base += manifest["windows"]
        doc_base = int(torch.cat(fields["doc"]).max()) + 1 if fields["doc"] else doc_base
    data = RouterData(
        {k: torch.cat(v) for k, v in fields.items()}, {n: torch.cat(h) for n, h in hidden.items()}, domains, pair or {}
    )
    return _drop_repeated_windows(data) if len(dirs) > 1 else data


def _drop_repeated_windows(data: RouterData) -> RouterData:
    """Dirs drawn from one corpus with other seeds can hold the same window twice; keep the first."""
    seen, repeated = set(), []
    windows, starts = torch.unique_consecutive(data.window, return_counts=True)
    offset = 0
    for w, n in zip(windows.tolist(), starts.tolist()):
        key = hashlib.sha1(data.token[offset : offset + n].numpy().tobytes()).digest()
        if key in seen:
            repeated.append(w)
        seen.add(key)
        offset += n
    return data.subset(~torch.isin(data.window, torch.tensor(repeated, dtype=data.window.dtype))) if repeated else data
