# SPDX-License-Identifier: Apache-2.0
"""The env report's ``Pipeline`` section (``deepspeed env_report --heterogeneous --pipeline-stages N``):
the global ranks of a ``PipelineModule(num_stages=N)`` job (``PipelineGrid``), and the stages and
data-parallel replicas they would get from this host's devices and the config's emulation, as
``pipeline.build_stages`` sees them when the engine starts."""

import dataclasses

from ..measure.devices import BYTES_PER_GB, describe_local_device, emulated_memory_bytes, local_device_count
from ..planning.stages import StagePartition, relative_rank_speeds, replica_sample_times, stage_speeds
from .report_text import format_table, per_rank


@dataclasses.dataclass(frozen=True)
class PipelineGrid:
    """The global ranks of a pipeline job and where their count came from."""

    stages: int
    processes: int
    source: str
    """Why there are ``processes`` ranks: the flag, the emulation lists or this host's devices."""

    @property
    def replicas(self):
        return self.processes // self.stages

    def coords(self):
        """Per global rank, (stage, replica): upstream's ``PipeDataParallelTopology``, the grid
        ``PipelineModule`` builds (the data axis varies fastest)."""
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
        topology = PipeDataParallelTopology(num_pp=self.stages, num_dp=self.replicas)
        return [(topology.get_coord(g).pipe, topology.get_coord(g).data) for g in range(self.processes)]


def pipeline_grid(settings, stages, world_size=None):
    """The ``PipelineGrid`` of `stages` stages: `world_size` processes, else one per entry of the
    enabled config's emulation lists (per global rank with a pipeline), else one per device of this
    host. Raises ValueError naming the flag or key and what is allowed."""
    if int(stages) < 1:
        raise ValueError(f"--pipeline-stages {stages} is not allowed: give the number of pipeline stages, an integer "
                         ">= 1")
    emulation = settings.config.emulation if settings.enabled else None
    lengths = {key: len(values) for key, values in (("speeds", emulation and emulation.speeds),
                                                    ("memory_gb", emulation and emulation.memory_gb)) if values}
    if world_size is not None:
        processes, source = int(world_size), "--world-size"
    elif lengths:
        if len(set(lengths.values())) > 1:
            raise ValueError("heterogeneous_config.emulation.speeds has {speeds} entries and emulation.memory_gb "
                             "{memory_gb}: with a pipeline both give one entry per global rank".format(**lengths))
        processes = next(iter(lengths.values()))
        source = f"one per heterogeneous_config.emulation.{next(iter(lengths))} entry"
    else:
        processes, source = local_device_count(), "one per device of this host; give --world-size for more"
    if processes % stages:
        divisors = [d for d in range(1, processes + 1) if processes % d == 0]
        raise ValueError(f"--pipeline-stages {stages} does not divide the job's {processes} process(es) ({source}): "
                         f"every data-parallel replica holds all stages; allowed: {', '.join(map(str, divisors))}")
    return PipelineGrid(stages, processes, source)


def pipeline_lines(settings, grid):
    """The env report's Pipeline section for `grid` (a ``PipelineGrid``) under `settings`.

    The speeds and memory are the runtime's (``pipeline.build_stages``); the layers per stage are
    known only when the config gives ``pipeline.stage_layers``: otherwise the engine cuts them
    from layer costs it measures as it starts. A replica's relative speed assumes such a cut, one
    that balances the stages (each stage's cost in proportion to its speed)."""
    stage_layers = settings.config.pipeline.stage_layers
    if stage_layers and len(stage_layers) != grid.stages:
        raise ValueError(f"heterogeneous_config.pipeline.stage_layers {list(stage_layers)} has {len(stage_layers)} "
                         f"entries but --pipeline-stages is {grid.stages}: give one entry per stage")
    emulation = settings.config.emulation if settings.enabled else None
    local_count = local_device_count()
    devices = {}  # as the runtime describes them: no benchmark, an unknown device scores 0
    scores, emulated, memory = [], [], []
    for g in range(grid.processes):
        local = g % local_count
        if local not in devices:
            devices[local] = describe_local_device(local_rank=local, measure=False, rank=g)
        scores.append(float(devices[local].spec_score))
        emulated.append(float(per_rank(emulation.speeds if emulation else None, g) or 1.0))
        memory.append(emulated_memory_bytes(emulation, g))
    speeds = relative_rank_speeds(scores, emulated)
    coords = grid.coords()
    per_stage = stage_speeds(speeds, [stage for stage, _ in coords], grid.stages)
    threshold = settings.memory.hbm_utilization_threshold

    lines = [f"Pipeline: {grid.stages} stage(s) x {grid.replicas} replica(s) = {grid.processes} processes "
             f"({grid.source}); global rank g: stage g // {grid.replicas}, replica g % {grid.replicas}"]
    rows = []
    for stage in range(grid.stages):
        ranks = [g for g, (s, _) in enumerate(coords) if s == stage]
        cells = ", ".join(f"{g} ({speeds[g]:.4g})" if memory[g] is None else
                          f"{g} ({speeds[g]:.4g}, {memory[g] / BYTES_PER_GB:g} GiB)" for g in ranks)
        known = [memory[g] for g in ranks if memory[g] is not None]
        limit = f"{min(known) * threshold / BYTES_PER_GB:.4g}" if known else "none"
        rows.append((stage, cells, f"{per_stage[stage]:.4g}", limit))
    lines += ["  " + line for line in format_table(("stage", "global ranks (speed, memory)", "speed",
                                                     "memory limit (GiB)"), rows).splitlines()]
    lines.append(f"  a rank's speed: its device's score relative to the fastest x its emulation.speeds entry; a "
                 f"stage's: its slowest replica's; a stage's memory limit: its least emulation.memory_gb x "
                 f"hbm_utilization_threshold {threshold:g}")
    lines.append(f"Stage Speeds: {[round(speed, 4) for speed in per_stage]}")

    # A replica's time per sample is its slowest stage's cost / speed (``replica_sample_times``);
    # with one unit layer per stage costing the stage's speed, the cut balances the stages.
    balanced = StagePartition(tuple(range(grid.stages + 1)), (1.0, ) * grid.stages, "balanced")
    times = replica_sample_times(balanced, per_stage, speeds, coords, grid.replicas)
    fastest = min(times)
    relative = [fastest / time for time in times]
    name = settings.config.load_balancing_strategy
    share = (f"; {name} gives each replica a micro-batch in proportion" if settings.enabled and
             settings.config.strategy.adapts else "")
    lines.append(f"Replica Speeds: {[round(speed, 4) for speed in relative]} (1: the fastest replica, once the cut "
                 f"balances the stages{share})")
    for replica in range(grid.replicas):
        ranks = [g for g, (_, r) in enumerate(coords) if r == replica]
        lines.append(f"  replica {replica}: global ranks {', '.join(map(str, ranks))} (stage order), relative "
                     f"pipeline speed {relative[replica]:.4g}")
    if stage_layers:
        lines.append(f"Layers per stage: {list(stage_layers)} (heterogeneous_config.pipeline.stage_layers)")
    else:
        weighed = ("the layer costs are measured then" if settings.config.pipeline.layer_cost == "measured" else
                   "each layer weighs its trainable parameters")
        lines.append(f"Layers per stage: decided as the engine starts ({weighed}; heterogeneous_config.pipeline."
                     f"layer_cost \"{settings.config.pipeline.layer_cost}\"), so the cut appears in the start-up "
                     "table of the training run (\"[deepspeed-hetero] pipeline: ...\")")
    if not settings.enabled:
        lines.append("note: PipelineModule(partition_method=\"heterogeneous\") needs heterogeneous_config.enabled; "
                     "without it the emulation is not applied and upstream's partition methods cut the layers")
    return lines
