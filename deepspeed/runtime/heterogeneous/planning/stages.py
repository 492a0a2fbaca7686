# SPDX-License-Identifier: Apache-2.0
"""Pipeline stages sized to their devices (docs/pipeline.md): pure arithmetic, no processes.

A ``PipelineModule`` with ``partition_method="heterogeneous"`` is cut into contiguous layer
ranges, one per stage, so that the slowest stage is as fast as it can be: stage ``s`` holding
layers ``[a, b)`` takes ``sum(cost[a:b]) / speed[s]`` per sample, and in a full pipeline every
micro-batch waits for the slowest stage. Upstream's ``parameters`` method balances the costs
alone, which on a stage at half speed doubles that stage's time.

``partition_stages`` solves the min-max problem exactly (dynamic programming over cut points,
``O(stages * layers**2)``), within each stage's byte limit when one is given. Each stage keeps at
least one layer. The same inputs give the same cuts on every rank (no floating-point order
depends on the rank).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

ADAM_BYTES_PER_PARAMETER = 16
"""fp32 weights, gradients and Adam's two moments: the bytes per parameter a stage holds
(``stage_state_bytes``) before activations."""


class StagePartitionError(ValueError):
    """No contiguous partition fits: the message names the setting that would make one."""


@dataclass(frozen=True)
class StagePartition:
    parts: tuple
    """Boundaries, ``len(stages) + 1`` entries: stage s holds layers ``parts[s]:parts[s + 1]``."""
    stage_times: tuple
    """Per stage, ``sum(cost of its layers) / speed``: the time of one sample's work there."""
    method: str

    @property
    def layers_per_stage(self):
        return tuple(b - a for a, b in zip(self.parts, self.parts[1:]))

    @property
    def bottleneck(self):
        return max(self.stage_times)


def _check(costs, speeds):
    if not speeds:
        raise StagePartitionError("a pipeline needs at least one stage")
    if len(costs) < len(speeds):
        raise StagePartitionError(f"{len(costs)} layer(s) cannot fill {len(speeds)} pipeline stages: each stage "
                                  f"needs at least one layer (use fewer stages)")
    if any(c < 0 for c in costs):
        raise StagePartitionError(f"layer costs must be >= 0, got {list(costs)}")
    if any(not s > 0 for s in speeds):
        raise StagePartitionError(f"stage speeds must be > 0, got {list(speeds)}")


def partition_stages(costs: Sequence[float], speeds: Sequence[float], layer_bytes: Optional[Sequence[float]] = None,
                     stage_capacity_bytes: Optional[Sequence[Optional[float]]] = None) -> StagePartition:
    """Contiguous layer ranges minimising the slowest stage's ``sum(costs) / speed``.

    Args:
        costs: per layer, its compute cost in any unit (parameter counts, measured seconds).
        speeds: per stage, its relative speed (the slowest replica's device at that stage).
        layer_bytes: per layer, the bytes a stage must hold for it (``ADAM_BYTES_PER_PARAMETER``
            times its parameters); only with ``stage_capacity_bytes``.
        stage_capacity_bytes: per stage, the most bytes it may hold (None: no limit).
    """
    _check(costs, speeds)
    layers, stages = len(costs), len(speeds)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    bytes_prefix = [0.0]
    for b in (layer_bytes or [0.0] * layers):
        bytes_prefix.append(bytes_prefix[-1] + float(b))
    limits = list(stage_capacity_bytes) if stage_capacity_bytes is not None else [None] * stages

    def fits(stage, a, b):
        return limits[stage] is None or bytes_prefix[b] - bytes_prefix[a] <= limits[stage]

    inf = float("inf")
    # best[s][i]: the least bottleneck of stages 0..s holding layers [0, i); cut[s][i] its last cut.
    best = [[inf] * (layers + 1) for _ in range(stages)]
    cut = [[-1] * (layers + 1) for _ in range(stages)]
    for i in range(1, layers - stages + 2):
        if fits(0, 0, i):
            best[0][i] = prefix[i] / speeds[0]
            cut[0][i] = 0
    for s in range(1, stages):
        for i in range(s + 1, layers - (stages - s - 1) + 1):
            for j in range(s, i):
                if best[s - 1][j] == inf or not fits(s, j, i):
                    continue
                value = max(best[s - 1][j], (prefix[i] - prefix[j]) / speeds[s])
                if value < best[s][i]:  # strict: the earliest cut wins ties, the same on every rank
                    best[s][i], cut[s][i] = value, j
    if best[stages - 1][layers] == inf:
        raise StagePartitionError(
            f"no contiguous split of {layers} layers over {stages} stages fits the stages' memory "
            f"({[None if c is None else round(c / 2**30, 3) for c in limits]} GiB for "
            f"{round(bytes_prefix[-1] / 2**30, 3)} GiB of model state): use more stages, or give the stages "
            f"more memory (heterogeneous_config.emulation.memory_gb on an emulated cluster)")
    parts = [layers]
    for s in range(stages - 1, -1, -1):
        parts.append(cut[s][parts[-1]])
    parts.reverse()
    return _described(parts, costs, speeds, "balanced")


def _described(parts, costs, speeds, method):
    times = tuple(sum(costs[a:b]) / speed for a, b, speed in zip(parts, parts[1:], speeds))
    return StagePartition(tuple(parts), times, method)


def manual_partition(stage_layers: Sequence[int], costs: Sequence[float], speeds: Sequence[float]) -> StagePartition:
    """``heterogeneous_config.pipeline.stage_layers``: layers per stage, in stage order."""
    _check(costs, speeds)
    if len(stage_layers) != len(speeds) or sum(stage_layers) != len(costs) or min(stage_layers) < 1:
        raise StagePartitionError(
            f"heterogeneous_config.pipeline.stage_layers {list(stage_layers)} must give each of the {len(speeds)} "
            f"stages at least one layer and sum to the PipelineModule's {len(costs)} layers")
    parts = [0]
    for n in stage_layers:
        parts.append(parts[-1] + int(n))
    return _described(parts, costs, speeds, "manual")


def given_partition(parts: Sequence[int], costs: Sequence[float], speeds: Sequence[float], method: str):
    """Describe an existing partition (upstream's ``parameters`` or ``uniform``) under the same model."""
    return _described(list(parts), costs, speeds, method)


def relative_rank_speeds(scores, emulated_speeds):
    """Per global rank, its speed relative to the fastest device: its device's spec score over the
    fastest score (1 for a device the table does not know: score 0), times its emulated speed."""
    fastest = max(scores) or 1.0
    return [speed * (score / fastest if score > 0 else 1.0) for score, speed in zip(scores, emulated_speeds)]


def stage_speeds(rank_speeds: Sequence[float], stage_of_rank: Sequence[int], stages: int) -> List[float]:
    """Per stage, the slowest speed among the ranks that hold it: every replica runs the same
    partition, and the data-parallel all-reduce waits for the slowest copy of each stage."""
    speeds = [None] * stages
    for speed, stage in zip(rank_speeds, stage_of_rank):
        speeds[stage] = speed if speeds[stage] is None else min(speeds[stage], speed)
    return [1.0 if s is None else float(s) for s in speeds]


def replica_sample_times(partition: StagePartition, costs: Sequence[float], rank_speeds: Sequence[float],
                         coords: Sequence[tuple], replicas: int) -> List[float]:
    """Per data-parallel replica, its time per sample in a full pipeline: its slowest stage's
    ``cost / speed`` (``coords[g] = (stage, replica)`` of global rank g)."""
    times = [0.0] * replicas
    for speed, (stage, replica) in zip(rank_speeds, coords):
        a, b = partition.parts[stage], partition.parts[stage + 1]
        times[replica] = max(times[replica], sum(costs[a:b]) / speed)
    return times


def balanced_bound(costs: Sequence[float], speeds: Sequence[float], micro_batches: int) -> float:
    """The ideal pipeline's time per sample: all stages busy all the time (``sum(costs) /
    sum(speeds)``, layers divisible at will), stretched by the bubble of a 1F1B schedule with
    ``micro_batches`` micro-batches per step, ``(m + S - 1) / m``."""
    stages = len(speeds)
    return sum(costs) / sum(speeds) * (micro_batches + stages - 1) / micro_batches
