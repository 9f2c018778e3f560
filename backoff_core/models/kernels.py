"""CPU inference kernels: oneDNN (mkldnn) linear layers in place of torch's default.

On CPU, torch runs `nn.Linear` through MKL's GEMM, which treats inputs of 2 or 3 rows as
separate matrix-vector products: a catch-up over 2 or 3 pending tokens then costs up to
twice as much as one over 8. oneDNN's linear with a pre-packed weight reads the weight
once for any row count and is faster at one row too (default pair, 2 threads: M_S step
9.9 -> ~5.6 ms with the LM head alone converted; M_L P_L(1) 39 -> 32 ms, P_L(2) 62 -> 38
ms with every linear converted; `benchmarks/cost_curve.py` measures it).

`torch.utils.mkldnn.MkldnnLinear` is torch's own module for this: same maths, weight held
in oneDNN's layout, inference only (no autograd). So this is applied by the inference
loaders (`loading.load_chain`, the Serve replicas), never to a model being trained.
Modules shared between models (M_S shares M_L's LM head) stay shared: a module is
converted once and every model that held it gets the same converted one.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import os
import weakref

import torch
from torch import nn
from torch.utils.mkldnn import MkldnnLinear

CPU_KERNELS = ("mkldnn", "default")
# oneDNN caches one primitive per input shape (default: 1024 of them, ~2 MB each for an LM
# head); serving sees many row counts, so a process would grow by a GB or more as the cache
# fills. Rows are padded to a power of two up to 256 and to a multiple of 256 above
# (RowBucketed), so a model's steps and catch-ups need about (distinct weight shapes) x 9
# primitives: 64 holds a small model's set; a long prefill may create a few more.
PRIMITIVE_CACHE = 64

# dense module -> its converted twin, so that shared modules stay shared across calls
_converted: "weakref.WeakKeyDictionary[nn.Linear, RowBucketed]" = weakref.WeakKeyDictionary()
_biasless: "weakref.WeakKeyDictionary[MkldnnLinear, bool]" = weakref.WeakKeyDictionary()


def applies(model: nn.Module) -> bool:
    """oneDNN linear fits a float32 model on the CPU of a torch built with oneDNN."""
    weight = next((p for p in model.parameters()), None)
    return weight is not None and converts(weight.device, weight.dtype)


def converts(device: str | torch.device, dtype: torch.dtype, kernels: str = "mkldnn") -> bool:
    """Whether use_cpu_kernels(kernels) would convert a model on `device` in `dtype`."""
    on_cpu = torch.device(device).type == "cpu"
    return kernels != "default" and on_cpu and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def use_cpu_kernels(model: nn.Module, kernels: str = "mkldnn") -> nn.Module:
    """Swap every nn.Linear of an inference model for oneDNN's (in place; returns the
    model). A no-op for kernels="default", off the CPU, or for other dtypes."""
    if kernels not in CPU_KERNELS:
        raise ValueError(f"unknown cpu kernels {kernels!r}; choose one of {', '.join(CPU_KERNELS)}")
    if kernels == "default" or not applies(model):
        return model
    # read by oneDNN when it creates its first primitive; a value set by the user stays
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, _mkldnn_twin(child))
    _return_freed_memory()
    return model


def _return_freed_memory() -> None:
    """The dense weights just dropped are about the model's size; glibc keeps such freed
    heap pages mapped (the default pair's M_L replica: 1.44 GB RSS after conversion, 1.03
    GB after a trim), so hand them back to the OS."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Return the C heap's free pages to the OS where the C library is glibc (a no-op
    elsewhere). Serving frees buffers of ever-changing sizes; a long-lived replica calls
    this now and then so that its RSS follows what it holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict the model had before conversion: dense tensors, and no bias where
    the linear layer had none (oneDNN's module holds a zero bias there)."""
    state = {name: t.to_dense() if t.is_mkldnn else t for name, t in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, MkldnnLinear) and _biasless.get(module, False):
            del state[f"{name}.bias" if name else "bias"]
    # RowBucketed adds a level to the names: <x>.linear.weight was <x>.weight
    bucketed = {name for name, module in model.named_modules() if isinstance(module, RowBucketed)}
    dense = {}
    for key, t in state.items():
        owner, _, leaf = key.rpartition(".")
        parent, _, last = owner.rpartition(".")
        dense[f"{parent}.{leaf}" if last == "linear" and parent in bucketed else key] = t
    return dense


BUCKET_STEP = 256  # above this many rows, rows are padded to a multiple of it, not a power of two


def row_bucket(m: int) -> int:
    """The padded row count of an m-row input: the next power of two up to BUCKET_STEP (the
    rows of a step or catch-up), then the next multiple of BUCKET_STEP (a prefill: padding
    2112 rows to 4096 nearly doubled its cost)."""
    if m <= BUCKET_STEP:
        return 1 << (m - 1).bit_length()
    return -(-m // BUCKET_STEP) * BUCKET_STEP


class RowBucketed(nn.Module):
    """oneDNN's linear over the rows padded to a bucket (row_bucket). Its cost is flat in the
    row count for the few rows of a step or catch-up, and its primitive cache then holds a
    handful of shapes per weight instead of one per catch-up length."""

    def __init__(self, linear: MkldnnLinear) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:  # what get_output_embeddings().weight.shape reads
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        m = rows.shape[0]
        bucket = row_bucket(m)
        if bucket != m:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, bucket - m))
        return self.linear(rows)[:m].reshape(*x.shape[:-1], -1)


def _mkldnn_twin(linear: nn.Linear) -> RowBucketed:
    twin = _converted.get(linear)
    if twin is None:
        with torch.no_grad():
            twin = RowBucketed(MkldnnLinear(linear, torch.float32))
        _converted[linear] = twin
        _biasless[twin.linear] = linear.bias is None
    return twin


def model_fingerprint(model) -> str:
    """Short hash of a model's weights (a head trained on another M_S is detectable)."""
    h = hashlib.sha1()
    for name, t in sorted(dense_state_dict(model).items()):  # whichever kernels run it
        h.update(name.encode())
        h.update(t.detach().flatten()[:2048].float().cpu().numpy().tobytes())
    return h.hexdigest()[:12]
