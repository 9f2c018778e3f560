"""A TorchDispatchMode that counts the ops a function dispatches that make a new tensor: on a GPU,
each is a kernel (test_static_forward.py, test_static_ragged.py)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Ops(TorchDispatchMode):
    """Counts the ops a forward dispatches that make a new tensor: not views, and a dtype cast
    (`to`, which torch lists as a possible view) only when it copies. A higher order op
    (FlexAttention's) counts as one: on a GPU it is one compiled kernel."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.count += 1
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.count += 1
        elif func.overloadpacket.__name__ == "to":  # a cast copies; a same-dtype `to` aliases
            self.count += out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()
        return out
