"""gpu_sim.py's what-ifs: another price of M_L's forwards or another device (`--what-if`),
and another hold (`--waits-off-at-live X`)."""

from __future__ import annotations

from backoff_core.engine.hold import CatchUpHold

WHAT_IF = {  # --what-if: another price of M_L's forwards than the GPU's measured one, or another device
    "ragged": "M_L's catch-ups as ragged forwards wherever they apply (static_ragged.py; KVSpec ragged 'on'), "
    "each at its measured replay where the run timed one, else at the measured dense view of its token bucket "
    "(GpuCosts.ragged_ms); without a what-if, 'auto': ragged where priced lower than the padded layout",
    "padded": "M_L's catch-ups padded alone (KVSpec ragged 'off': the blocks layout, no ragged forward)",
    "unpadded": "an M_L forward costs what its real tokens alone would in the measured dense view, "
    "no padding, no gathered keys (GpuCosts.unpadded_ms; a layout that does not exist)",
    "shared": "catch-ups in flight share one GPU with M_S's steps, each slowed beside the other as "
    "gpu_check.json's `sharing` probe measured, or fairly (each at half speed) where the run has none "
    "(SimLauncher sharing; a model of one GPU, not a bound)",
}


def ragged_mode(what_if: list[str]) -> str:
    """KVSpec.ragged for a --what-if: "on" (ragged), "off" (padded; unpadded prices padded
    layouts), else the engine's default on CUDA, "auto"."""
    if "ragged" in what_if:
        return "on"
    return "off" if {"padded", "unpadded"} & set(what_if) else "auto"


class WaitsOffAtLive(CatchUpHold):
    """What-if (--waits-off-at-live X): the engine's hold, except that nothing waits in a step
    with at most `live` live requests (a drain or a light load), the waiting ones catching up."""

    def __init__(self, hold: CatchUpHold, live: int) -> None:
        super().__init__(hold.wait_ms, hold.clock, hold.collect_kl)
        self.max_share, self.live = hold.max_share, live

    def split(self, level, group, holders, live, proposal):
        if live <= self.live:
            self.resume(group, proposal)
            return group
        return super().split(level, group, holders, live, proposal)
