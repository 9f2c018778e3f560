"""The step loop's one way from the device to the host.

A device-to-host read waits for everything queued before it, so each is a sync point of
the step (on a GPU, the host stops until the device is done). The step loop reads once
per stage, whatever the batch size: stage 2+4 (propose.py) reads the tokens M_S's steps
drew together with the routers' scores; each catch-up level (catchup.py) reads its drawn
tokens with its verification's tests; committing reads the logprobs of the requests that
ask for them. Everything else the step loop decides on the host is decided from host data
(token ids, lengths, parameters, the values read here). Every read goes through `to_host`
(or its two halves, `start_read` and `Read.values`: propose queues M_S's next step between
them when it is launched ahead, ahead.py, and the wait is for the copy alone), and
tests/backoff_core/engine/test_host_reads.py counts them and fails on any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_host(*parts: torch.Tensor) -> list[list]:
    """parts: tensors of any shapes -> each as a Python list (nested like the tensor), in
    ONE device-to-host copy. Values travel as float64: floats of any precision and
    integers up to 2^53 (token ids) are exact; integer and bool parts come back as ints.
    No parts, or only empty ones: no copy."""
    return Read(parts, queued=False).values()


class Read:
    """One copy of parts to the host. queued (`start_read`): on CUDA the copy is queued into
    pinned memory and `values()` waits for it alone, not for what was queued after it (an M_S
    step launched ahead: engine/ahead.py); else (`to_host`) `values()` copies and waits for
    everything queued before."""

    def __init__(self, parts: Sequence[torch.Tensor], queued: bool) -> None:
        self.parts = parts
        self.sizes = [p.numel() for p in parts]
        self.copy: torch.Tensor | None = None  # [sum(sizes)] on the host
        self.done: torch.cuda.Event | None = None
        if not sum(self.sizes):
            return
        device = next((p.device for p in parts if p.device.type != "cpu"), torch.device("cpu"))
        self.exact = [not (p.dtype.is_floating_point or p.dtype.is_complex) for p in parts]
        # token ids alone come back as ints as they are
        self.dtype = torch.int64 if all(self.exact) else torch.float64
        flat = [p.reshape(-1).to(device=device, dtype=self.dtype) for p in parts]
        flat = flat[0] if len(flat) == 1 else torch.cat(flat)
        if device.type == "cuda" and queued:  # into pinned memory, asynchronously; the event marks its end
            self.copy = torch.empty(flat.shape, dtype=self.dtype, pin_memory=True)
            self.copy.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.copy = flat  # on the CPU, or read by values() (the copy and the sync)

    def values(self) -> list[list]:
        """The parts as Python lists (the sync: waits for this copy)."""
        if self.copy is None:
            return [_shape([], p) for p in self.parts]
        if self.done is not None:
            self.done.synchronize()
        values = self.copy.tolist()  # on a device: the copy (and the sync)
        out, at = [], 0
        for p, n, integral in zip(self.parts, self.sizes, self.exact):
            chunk = values[at : at + n]
            at += n
            if integral and self.dtype is torch.float64:
                chunk = list(map(int, chunk))
            out.append(_shape(chunk, p))
        return out


def start_read(*parts: torch.Tensor, queued: bool = True) -> Read:
    """to_host's copy, queued now and read by `Read.values()`: what the host queues in
    between runs on the device meanwhile, and the read does not wait for it. queued=False:
    to_host's own read, later."""
    return Read(parts, queued)


def _shape(values: list, like: torch.Tensor) -> list:
    """A flat list -> nested like a 1-D or 2-D tensor (0-D: a list of one)."""
    if like.dim() < 2:
        return values
    if like.dim() > 2:
        raise ValueError(f"to_host reads tensors of at most 2 dimensions, got shape {tuple(like.shape)}")
    rows, width = like.shape
    return [values[i * width : (i + 1) * width] for i in range(rows)]
