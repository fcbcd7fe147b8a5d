"""Where a decode step computes each expert it misses: on the device after a copy, or on the host.

A missed expert's weights already lie in host memory. At batch size 1, reading them there and
computing one token on the host cores costs about as much as copying them over the link
(Mixtral-size bf16: 7.0 ms on 16 cores against 6.4 ms on PCIe 5, ~14 ms on PCIe 4), and the two
run side by side without slowing each other. So the misses of a step are split between the two
lanes so that both finish as early as possible: each miss goes to the lane that would finish it
sooner, copies first on a tie (a copied expert stays cached for later tokens).

Whole experts leave the lanes unbalanced (one Mixtral-size miss on the H200 host: 6.4 ms on the link
while the host idles). With `share`, one expert of the later lane is then shared: the host computes
a fraction of its intermediate neurons and output rows from its host buffer, the device the rest
from a partial copy, so both lanes end together (one miss: 6.4 → 3.3 ms). A shared expert is not
cached by the step (the device holds only part of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_SHARE = 0.1  # a smaller part on either side does not pay for the step's extra exchange
MIN_GAIN = 0.1  # share only when the step's misses finish at least this much sooner


@dataclass(frozen=True)
class MissCosts:
    """Measured at start-up on this machine, in ms per expert (one token)."""

    copy_ms: float  # host → device copy of one expert
    host_ms: float  # one expert computed on the host cores

    def gains(self, share: bool = False) -> bool:
        """Two misses finish sooner with one on each lane than with both copied; with `share`, also a
        lone miss shared by both lanes (host and copy ending together) finishes sooner than its copy."""
        whole = max(self.copy_ms, self.host_ms) < 2 * self.copy_ms
        shared_ms = self.host_ms * self.copy_ms / (self.host_ms + self.copy_ms)
        return whole or (share and shared_ms <= (1 - MIN_GAIN) * self.copy_ms)


@dataclass(frozen=True)
class MissPlan:
    """Where a step's misses are computed; the misses in neither list are copied."""

    on_host: list[int] = field(default_factory=list)  # whole, on the host cores
    shared: int | None = None  # computed part on the host, part on the device
    host_fraction: float = 0.0  # the shared expert's part on the host
    copied: list[int] = field(default_factory=list)  # the misses copied whole

    @property
    def link_idle(self) -> bool:
        """The step moves nothing over the link."""
        return not self.copied and self.shared is None


class MissPlanner:
    def __init__(self, costs: MissCosts, share: bool = False) -> None:
        self.costs = costs
        self.share = share

    def plan(self, misses: Sequence[int], link_busy: bool = False) -> MissPlan:
        """`split`, then (with `share`) one expert of the lane that ends later shared so both end together.

        Not while the link is busy with earlier copies (prefetches of experts the host computed): a copy
        in flight cannot be overtaken, so the device's part would wait for it (in the timed replay,
        sharing then made random routing on a desktop 0.50 → 0.69 of copy-only)."""
        on_host = self.split(misses)
        copied = [e for e in misses if e not in on_host]
        if not self.share or link_busy or not misses:
            return MissPlan(on_host, copied=copied)
        host, link = self.costs.host_ms, self.costs.copy_ms
        host_ms, link_ms = len(on_host) * host, len(copied) * link
        if host_ms > link_ms:
            expert, host_rest, link_rest = on_host[-1], host_ms - host, link_ms
        else:
            expert, host_rest, link_rest = copied[-1], host_ms, link_ms - link
        fraction = (link_rest + link - host_rest) / (host + link)  # host_rest + f·host = link_rest + (1 − f)·link
        ends_at = host_rest + fraction * host
        if not MIN_SHARE <= fraction <= 1 - MIN_SHARE or ends_at > (1 - MIN_GAIN) * max(host_ms, link_ms):
            return MissPlan(on_host, copied=copied)
        return MissPlan([e for e in on_host if e != expert], expert, fraction, [e for e in copied if e != expert])

    def split(self, misses: Sequence[int]) -> list[int]:
        """The misses to compute on the host (in their order); the rest are copied."""
        link_ms = host_ms = 0.0
        on_host = []
        for expert in misses:
            if host_ms + self.costs.host_ms < link_ms + self.costs.copy_ms:
                on_host.append(expert)
                host_ms += self.costs.host_ms
            else:
                link_ms += self.costs.copy_ms
        return on_host
