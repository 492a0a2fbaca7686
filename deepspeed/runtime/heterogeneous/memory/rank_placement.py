# SPDX-License-Identifier: Apache-2.0
"""The memory pool's decision as data (``pool.py``): per rank, the bytes of each kind of state and
where they live (``RankPlacement``), the placement of one model over all ranks (``MemoryPlacement``),
and the error for what fits nowhere (``MemoryPlacementError``)."""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .model_state import RankCannotFitError
from .report import DEVICE

HOST, NVME = "host", "nvme"


class MemoryPlacementError(RankCannotFitError):
    """A rank's state, or a node's offloaded state, fits none of the places allowed."""


@dataclass(frozen=True)
class RankPlacement:
    """One rank's placement: bytes of each kind of state and where it lives."""

    rank: int
    host: int
    name: str
    capacity_bytes: Optional[int]
    budget_bytes: Optional[float]
    share: float
    """The rank's fraction of the partitioned state (ZeRO-0: 1, the whole model)."""
    parameter_bytes: float
    gradient_bytes: float
    optimizer_bytes: float
    """Optimizer state and the fp32 master copy of the rank's share."""
    activation_bytes: Optional[float] = None
    optimizer_location: str = DEVICE
    """"device", "host" or "nvme": where the offloaded part of the optimizer state lives."""
    offload_fraction: float = 0.0
    """Part of the optimizer state off the device: 0, 1, or a ZeRO-3 ratio."""
    offload_sub_groups: Optional[int] = None
    """ZeRO-3 with known sub-groups: how many of them (the last ones) are offloaded."""
    slack_bytes: float = 0.0
    """What rounding the shares to millionths may add over a budget they were cut to fit."""
    baseline_bytes: float = 0.0
    """In use on the device when the engine started (``meter.py``): the interpreter, the model."""
    predicted_peak_bytes: Optional[int] = None
    """The rank's predicted peak (``peak.py``): baseline, model state, activations and
    DeepSpeed's buffers at the busiest phase; None where the allocations are unknown."""
    peak_phase: Optional[str] = None
    measured_peak_bytes: Optional[int] = None
    """The peak the rank measured (``meter.py``), None until measured."""

    def alike(self, **fields):
        """This placement for another rank placed alike: ``dataclasses.replace`` without running
        ``__init__`` again (the pool places ranks by the thousand, most of them alike); ``fields``
        must be RankPlacement's (not checked here)."""
        copy = object.__new__(RankPlacement)
        object.__setattr__(copy, "__dict__", {**self.__dict__, **fields})
        return copy

    @property
    def offloaded_bytes(self):
        return self.optimizer_bytes * self.offload_fraction

    @property
    def host_bytes(self):
        return self.offloaded_bytes if self.optimizer_location == HOST else 0.0

    @property
    def buffer_bytes(self):
        """What the predicted peak holds beyond the baseline, the kept model state and activations."""
        if self.predicted_peak_bytes is None:
            return 0.0
        return max(0.0, self.predicted_peak_bytes - self.baseline_bytes - self.parameter_bytes - self.gradient_bytes -
                   self.optimizer_bytes + self.offloaded_bytes - (self.activation_bytes or 0.0))

    @property
    def device_bytes(self):
        if self.predicted_peak_bytes is not None:
            return self.predicted_peak_bytes
        return math.ceil(self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes - self.offloaded_bytes +
                         (self.activation_bytes or 0.0))

    @property
    def room_bytes(self):
        return None if self.budget_bytes is None else self.budget_bytes - self.device_bytes

    @property
    def fits(self):
        return self.budget_bytes is None or self.device_bytes <= self.budget_bytes + self.slack_bytes


@dataclass(frozen=True)
class MemoryPlacement:
    """The pool's decision for one model: every rank's placement and what could not be placed."""

    zero_stage: int
    ranks: Tuple[RankPlacement, ...]
    partition_shares: Optional[Tuple[float, ...]]
    """The ZeRO-1/2/3 shares for ``heterogeneous_memory.zero_partitions`` (None: upstream's 1/N)."""
    host_budget_bytes: Optional[int]
    problems: Tuple[str, ...] = ()

    @property
    def offloaded_ranks(self):
        return [r.rank for r in self.ranks if r.offload_fraction > 0]

    def host_bytes(self, host):
        return sum(r.host_bytes for r in self.ranks if r.host == host)
