# SPDX-License-Identifier: Apache-2.0
"""A load-balancing strategy of one's own, in one module: micro-batches in proportion to each
rank's speed per sample, ignoring fixed costs (the worked example of docs/extending.md).

    import proportional  # registers "proportional"
    config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "proportional"}
    engine, *_ = deepspeed.initialize(...)

Every rank imports this module before ``deepspeed.initialize``. The strategy adapts: after the
profiling steps the fork asks it again with the measured time models (and at the switch check,
and with dynamic rebalancing).
"""

import math

from deepspeed.runtime.heterogeneous.planning.strategies import BalancingStrategy, register_strategy


class Proportional(BalancingStrategy):
    """Rank i gets ``samples * speed_i / sum(speeds)`` samples per micro-step, where ``speed_i`` is
    the inverse of its time per sample; whole samples by largest remainder (ties to the lower rank),
    at least one per rank."""

    name = "proportional"
    label = "Proportional"
    adapts = True

    def plan(self, request):
        speeds = [1.0 / model.b if model.b > 0 else 1.0 for model in request.time_models]
        samples = request.samples_per_micro_step
        quotas = [samples * speed / sum(speeds) for speed in speeds]
        sizes = [max(1, math.floor(quota)) for quota in quotas]
        by_remainder = sorted(range(len(sizes)), key=lambda rank: (sizes[rank] - quotas[rank], rank))
        while sum(sizes) < samples:  # hand out what the floors left, largest remainder first
            rank = by_remainder.pop(0)
            sizes[rank] += 1
        while sum(sizes) > samples:  # the minimum of one took too many: take back where least is lost
            above_one = [rank for rank in range(len(sizes)) if sizes[rank] > 1]
            sizes[max(above_one, key=lambda rank: (sizes[rank] - quotas[rank], -rank))] -= 1
        return request.fixed_plan(sizes)


register_strategy(Proportional())
