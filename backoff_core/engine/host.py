"""The step loop's one way from the device to the host.

A device-to-host read waits for everything queued before it, so each is a sync point of
the step (on a GPU, the host stops until the device is done). The step loop reads once
per stage, whatever the batch size: stage 2+4 (propose.py) reads the tokens M_S's steps
drew together with the routers' scores; each catch-up level (catchup.py) reads its drawn
tokens with its verification's tests; committing reads the logprobs of the requests that
ask for them. Everything else the step loop decides on the host is decided from host data
(token ids, lengths, parameters, the values read here). Every read goes through `to_host`,
and tests/backoff_core/engine/test_host_reads.py counts them and fails on any other.
"""

from __future__ import annotations

import torch


def to_host(*parts: torch.Tensor) -> list[list]:
    """parts: tensors of any shapes -> each as a Python list (nested like the tensor), in
    ONE device-to-host copy. Values travel as float64: floats of any precision and
    integers up to 2^53 (token ids) are exact; integer and bool parts come back as ints.
    No parts, or only empty ones: no copy."""
    sizes = [p.numel() for p in parts]
    if not sum(sizes):
        return [_shape([], p) for p in parts]
    device = next((p.device for p in parts if p.device.type != "cpu"), torch.device("cpu"))
    exact = [not (p.dtype.is_floating_point or p.dtype.is_complex) for p in parts]
    dtype = torch.int64 if all(exact) else torch.float64  # token ids alone come back as ints as they are
    flat = [p.reshape(-1).to(device=device, dtype=dtype) for p in parts]
    values = (flat[0] if len(flat) == 1 else torch.cat(flat)).tolist()  # the copy (and the sync)
    out, at = [], 0
    for p, n, integral in zip(parts, sizes, exact):
        chunk = values[at : at + n]
        at += n
        if integral and dtype is torch.float64:
            chunk = list(map(int, chunk))
        out.append(_shape(chunk, p))
    return out


def _shape(values: list, like: torch.Tensor) -> list:
    """A flat list -> nested like a 1-D or 2-D tensor (0-D: a list of one)."""
    if like.dim() < 2:
        return values
    if like.dim() > 2:
        raise ValueError(f"to_host reads tensors of at most 2 dimensions, got shape {tuple(like.shape)}")
    rows, width = like.shape
    return [values[i * width : (i + 1) * width] for i in range(rows)]
