"""A TorchDispatchMode that records the aten ops a function dispatches and which of them would
sync with the host (capture safety: test_capture_safety.py, test_static_ragged.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that wait for the device or size their output by its data
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "nonzero_static", "masked_select", "is_nonzero", "equal"}
SYNC_PREFIXES = ("unique", "_unique")
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


class HostSyncs(TorchDispatchMode):
    """Records every aten op a function dispatches, and which of them would sync. A higher
    order op (FlexAttention's) is recorded by name and run as one: on a GPU it is one compiled
    kernel, whose inside the fullgraph compile checks."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.ops.append(func.name())
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in SYNC_OPS or name.startswith(SYNC_PREFIXES):
            self.syncs.append(name)
        if name in INDEX_OPS and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (args[1] if len(args) > 1 else ()) or ()
        ):
            self.syncs.append(f"{name} with a bool index")
        if name == "_to_copy" and "device" in kwargs and kwargs["device"] != args[0].device:
            self.syncs.append(f"_to_copy to {kwargs['device']}")
        if name == "copy_" and args[0].device != args[1].device:
            self.syncs.append(f"copy_ {args[1].device} -> {args[0].device}")
        return func(*args, **kwargs)
