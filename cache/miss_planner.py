"""Where a decode step computes each expert it misses: on the device after a copy, or on the host.

A missed expert's weights already lie in host memory. At batch size 1, reading them there and
computing one token on the host cores costs about as much as copying them over the link
(Mixtral-size bf16: 7.0 ms on 16 cores against 6.4 ms on PCIe 5, ~14 ms on PCIe 4), and the two
run side by side without slowing each other. So the misses of a step are split between the two
lanes so that both finish as early as possible: each miss goes to the lane that would finish it
sooner, copies first on a tie (a copied expert stays cached for later tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MissCosts:
    """Measured at start-up on this machine, in ms per expert (one token)."""

    copy_ms: float  # host → device copy of one expert
    host_ms: float  # one expert computed on the host cores

    def gains(self) -> bool:
        """Two misses finish sooner with one on each lane than with both copied."""
        return max(self.copy_ms, self.host_ms) < 2 * self.copy_ms


class MissPlanner:
    def __init__(self, costs: MissCosts) -> None:
        self.costs = costs

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
