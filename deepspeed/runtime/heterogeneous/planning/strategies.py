# SPDX-License-Identifier: Apache-2.0
"""The built-in load-balancing strategies, and what a strategy of one's own needs.

``heterogeneous_config.load_balancing_strategy`` names a registered ``BalancingStrategy``
(``config/strategies.py`` holds the registry). The fork never compares the name: it reads the
strategy's traits (``adapts``: measured and asked again; ``takes_sizes``: reads
``micro_batch_sizes``) and calls its ``plan(request)``:

- at start-up, with time models from the devices' prior scores (equal where unknown);
- after each profiling step, at the switch check and when dynamic rebalancing re-plans, with the
  measured time models, when the strategy ``adapts``.

The built-ins:

- ``uniform``: equal micro-batches, upstream's split;
- ``manual``: the user's ``micro_batch_sizes`` (per rank, or by device name);
- ``compute_aware``: the exact integer split that minimises the slowest rank's predicted time
  within each rank's memory (``allocation.py``, ``integer_split.py``); adapts.

A new strategy is one module: subclass ``BalancingStrategy``, build the plan with
``request.fixed_plan(sizes)`` (or ``request.plan``), ``register_strategy(...)`` it. Pure logic.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..config.strategies import (BalancingStrategy, get_strategy, register_strategy, strategy_names,
                                 unregister_strategy)
from .allocation import compute_aware_plan, fixed_plan, manual_sizes, uniform_sizes

__all__ = ["BalancingStrategy", "PlanRequest", "get_strategy", "register_strategy", "strategy_names",
           "unregister_strategy", "COMPUTE_AWARE", "MANUAL", "UNIFORM"]


@dataclass(frozen=True)
class PlanRequest:
    """What a strategy plans from; the planner has checked it (``planner.plan_micro_batches``)."""

    time_models: Sequence
    """One ``TimeModel`` per data-parallel rank: ``a + b * micro_batch`` seconds per micro-step."""
    train_batch_size: int
    gradient_accumulation_steps: int
    caps: List[Optional[int]]
    """Per rank, the most samples per micro-step its memory holds (None: no limit)."""
    device_names: Optional[List[str]] = None
    sizes: object = None
    """``micro_batch_sizes`` as configured (for a strategy that ``takes_sizes``)."""
    allow_per_rank_gas: bool = False
    """Whether ranks may run different numbers of micro-steps (ZeRO-0/1)."""
    strategy: str = ""
    """The name the plan is recorded under."""

    @property
    def world_size(self):
        return len(self.time_models)

    @property
    def samples_per_micro_step(self):
        return self.train_batch_size // self.gradient_accumulation_steps

    def fixed_plan(self, sizes):
        """The plan that runs ``sizes`` (one per rank, summing to ``samples_per_micro_step``) at
        the configured gas, with each rank's predicted time and a note where a size exceeds its
        rank's memory cap."""
        return fixed_plan(self.time_models, [int(s) for s in sizes], self.gradient_accumulation_steps,
                          self.train_batch_size, self.strategy, self.caps)


class Uniform(BalancingStrategy):
    """Equal micro-batches on every rank, as upstream splits the batch."""

    name, label = "uniform", "Uniform"

    def plan(self, request):
        return request.fixed_plan(uniform_sizes(request.train_batch_size, request.gradient_accumulation_steps,
                                                request.world_size))


class Manual(BalancingStrategy):
    """The sizes of ``micro_batch_sizes``: a list per rank or a map from device name to size."""

    name, label, takes_sizes = "manual", "Manual", True

    def plan(self, request):
        return request.fixed_plan(manual_sizes(request.sizes, request.world_size, request.device_names,
                                               request.train_batch_size, request.gradient_accumulation_steps))


class ComputeAware(BalancingStrategy):
    """The split that minimises the slowest rank's predicted step time within the memory caps
    (per-rank gas where allowed and faster); measured and re-planned."""

    name, label, adapts = "compute_aware", "Compute-Aware", True

    def plan(self, request):
        return compute_aware_plan(request.time_models, request.train_batch_size, request.gradient_accumulation_steps,
                                  request.caps, request.allow_per_rank_gas, strategy=request.strategy)


UNIFORM = register_strategy(Uniform()).name
MANUAL = register_strategy(Manual()).name
COMPUTE_AWARE = register_strategy(ComputeAware()).name
