# SPDX-License-Identifier: Apache-2.0
"""``ds_report --heterogeneous``: this host's devices and what a ds_config makes of them.

Besides the device table it prints four lines that users and scripts grep for (the README's
env_report section), exactly as::

    Heterogeneous Environment: Enabled|Disabled
    Mixed GPU Support: <distinct device names> | none (CPU accelerator: <model>; ...)
    Load Balancing Strategy: Compute-Aware|Uniform|Manual
    Communication Optimization: Active|Inactive

and, when the fork is enabled, the parts under the last one, indented: ``  <part>; <part>; ...``
(which part is in force, or why not).

With ``--pipeline-stages N`` it adds a ``Pipeline`` section (``pipeline_report.pipeline_lines``): the
stages and data-parallel replicas a ``PipelineModule(num_stages=N)`` would get from these devices and
the config's emulation, as ``pipeline.build_stages`` sees them when the engine starts.
"""

import argparse
import dataclasses
import json
import math
import sys

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

from ..comm.status import communication_status
from ..config.errors import invalid_json_message
from ..config.settings import load_heterogeneous_settings
from ..measure.device_benchmark import measured_score
from ..measure.devices import BYTES_PER_GB, describe_local_device, emulated_memory_bytes, local_device_count
from ..memory.placement import engine_placement
from ..memory.pool import HeterogeneousMemoryPool, ModelStateSpec, known_speeds
from ..measure.native import native_op_status
from ..planning.precision import choose_precision_for_config
from ..planning.strategies import UNIFORM, get_strategy
from .pipeline_report import pipeline_grid, pipeline_lines
from .report_text import format_table, per_rank

try:
    # DeepSpeed itself reads ds_config files with hjson, which also accepts comments.
    import hjson as _config_parser
except ImportError:
    _config_parser = json



def communication_optimization_active(settings, topology=None):
    """Whether heterogeneity-aware communication (``heterogeneous_config.communication``: the
    hierarchical reduction, link-aware buckets, inter-host compression) is in force under
    `settings` on `topology`. Every part needs ranks on more than one host, which a report from a
    config on one host does not have (topology None): False there, and the line after it says what
    ``auto`` would switch on (``comm/status.communication_status``)."""
    return communication_status(settings, topology)[0]


def read_config_file(path):
    """The ds_config at `path` as a dict. Raises ValueError naming the path and the problem."""
    try:
        with open(path) as config_file:
            param_dict = _config_parser.load(config_file)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(invalid_json_message(path, exc)) from None
    if not isinstance(param_dict, dict):
        raise ValueError(f"config {path} must hold a JSON object, not {type(param_dict).__name__}")
    return param_dict



def _device_rows(settings):
    """(DeviceDescription, memory emulated?, speed emulated?) per local device, or per emulated
    rank when the enabled config emulates a cluster on this host's devices.

    Each row is described as the runtime describes its rank (``cluster/ranks.gather_devices``): this
    host's device with the rank's emulated capacity. Unlike the runtime, the report benchmarks a
    device the table does not know, to show its measured score, and scales a score by the rank's
    emulated speed, which the runtime only meets when it profiles."""
    local_count = local_device_count()
    emulation = settings.config.emulation if settings.enabled else None
    speeds = emulation.speeds if emulation else None
    ranks = max(len(emulation.memory_gb or ()), len(speeds or ())) if emulation else 0
    rows = []
    for rank in range(ranks or local_count):
        memory_bytes, speed = emulated_memory_bytes(emulation, rank), per_rank(speeds, rank)
        device = describe_local_device(local_rank=rank % local_count, memory_bytes=memory_bytes, rank=rank)
        if speed is not None:
            device = dataclasses.replace(device, spec_score=device.spec_score * speed)
        rows.append((device, memory_bytes is not None, speed is not None))
    return rows



def _device_table(rows):
    header = ("rank", "host", "device", "memory (GiB)", "bf16", "fp16", "score (TFLOP/s)", "source")
    cells = []
    for device, memory_emulated, speed_emulated in rows:
        memory = f"{device.memory_bytes / BYTES_PER_GB:.1f}" + (" (emulated)" if memory_emulated else "")
        score = f"{device.spec_score:.4g}" + (" (emulated)" if speed_emulated else "")
        cells.append((device.rank, device.host, device.name, memory, "yes" if device.bf16 else "no",
                      "yes" if device.fp16 else "no", score, _score_source(device)))
    return format_table(header, cells)


def _model_fields(model):
    return ", ".join(f"{key}={value}" for key, value in model.model_dump().items())


def _config_options(settings):
    """(option, value) of each fork block the config gives (or the environment enables); a
    block the config does not mention is left out rather than listed with its defaults."""
    config = settings.config
    options = []
    if config.model_fields_set or settings.enabled:
        sizes = config.micro_batch_sizes
        options += [
            ("load_balancing_strategy", config.load_balancing_strategy),
            ("mixed_precision_support", config.mixed_precision_support),
            ("profile_steps", config.profile_steps),
            ("micro_batch_sizes", "none (the strategy decides)" if sizes is None else sizes),
            ("scheduler", _model_fields(config.scheduler)),
            ("emulation", "off" if config.emulation is None else _model_fields(config.emulation)),
        ]
    if settings.memory.model_fields_set:
        options.append(("heterogeneous_memory", _model_fields(settings.memory)))
    if settings.offload.model_fields_set:
        options.append(("zero_optimization.heterogeneous_offload", _model_fields(settings.offload)))
    return options


def _mixed_gpu_support(rows):
    """The distinct device models; on the CPU accelerator, what that means for the fork."""
    names = ", ".join(dict.fromkeys(device.name for device, _, _ in rows))
    if all(device.accelerator == "cpu" for device, _, _ in rows):
        return f"none (CPU accelerator: {names}; heterogeneous_config.emulation emulates a mixed cluster on it)"
    return names


def _score_source(device):
    """The table's source column: a measured score says how noisy its measurement was."""
    if device.score_source != "measured":
        return device.score_source
    measured = measured_score(get_accelerator().device_name(device.local_rank))
    return f"measured ({measured.describe()})" if measured is not None else device.score_source


def _precision_line(settings, param_dict, devices):
    """(what the ranks train in and why, what it overrides or None) for a config.

    The choice is the runtime's own (``coordinator.coordinate``): the fork's setting
    applied to a copy of the config; otherwise upstream's typed fp16/bf16 blocks decide."""
    mode = settings.config.mixed_precision_support if settings.enabled else "config"
    choice = choose_precision_for_config(mode, devices, dict(param_dict))
    if choice is None:
        fp16, bf16 = get_float16_config(param_dict).enabled, get_bfloat16_config(param_dict).enabled
        return f"{'fp16' if fp16 else 'bf16' if bf16 else 'fp32'} (the config's fp16/bf16 blocks)", None
    return f"{choice.dtype} ({choice.reason})", choice.overridden


def heterogeneous_report(config_path=None, file=None, model_parameters=None, pipeline_stages=None, world_size=None):
    """Print the heterogeneous environment report.

    Args:
        config_path: a ds_config file whose heterogeneous blocks decide what is enabled. Default
            None: the environment decides (DS_HETEROGENEOUS_ENV=1 enables the compute_aware
            defaults; otherwise disabled).
        file: where to print. Default None: sys.stdout at call time.
        model_parameters: with a config, the model's parameter count: the report then shows the
            memory placement the config would get (``config_placement_lines``).
        pipeline_stages: the pipeline degree (``PipelineModule(num_stages=...)``, which is not in the
            config): the report then shows the stages and replicas (``pipeline_lines``). Default None.
        world_size: with ``pipeline_stages``, the job's processes. Default None: one per entry of
            the enabled config's emulation lists, else one per device of this host.

    Raises ValueError, before printing anything, when the config, the environment or the pipeline
    arguments are invalid.
    """
    param_dict = read_config_file(config_path) if config_path is not None else {}
    pristine = dict(param_dict)  # load_heterogeneous_settings moves a top-level scheduler alias out of it
    settings = load_heterogeneous_settings(param_dict)
    rows = _device_rows(settings)
    if world_size is not None and pipeline_stages is None:
        raise ValueError("--world-size is only used with --pipeline-stages; leave it out or add --pipeline-stages N")
    pipeline = None
    if pipeline_stages is not None:
        grid = pipeline_grid(settings, pipeline_stages, world_size)
        # The runtime's own check of the per-rank lists (emulation per global rank, micro_batch_sizes
        # per replica), so that a config the report accepts is one the engine accepts.
        load_heterogeneous_settings(pristine, world_size=grid.replicas, process_count=grid.processes)
        pipeline = pipeline_lines(settings, grid)
    precision = _precision_line(settings, param_dict, [device for device, _, _ in rows])
    strategy = settings.config.strategy if settings.enabled else get_strategy(UNIFORM)

    file = sys.stdout if file is None else file

    def emit(line=""):
        print(line, file=file)

    emit("DeepSpeed heterogeneous environment report")
    emit(f"deepspeed version: {deepspeed.__version__}")
    emit(f"accelerator: {get_accelerator().device_name()}")
    emit(f"native op: {native_op_status()}")
    emit(f"config: {config_path if config_path is not None else 'none (environment only)'}")
    emit()
    emit(_device_table(rows))
    emit()
    emit(f"Heterogeneous Environment: {'Enabled' if settings.enabled else 'Disabled'}")
    if not settings.enabled:
        how = ("the config has no \"heterogeneous_config\": {\"enabled\": true}" if config_path is not None else
               "no config given and DS_HETEROGENEOUS_ENV is unset")
        emit(f"note: heterogeneous training is off ({how}); to enable it, add \"heterogeneous_config\": "
             f"{{\"enabled\": true}} to the ds_config and pass it with --config, or set DS_HETEROGENEOUS_ENV=1")
    emit(f"Mixed GPU Support: {_mixed_gpu_support(rows)}")
    emit(f"Load Balancing Strategy: {strategy.label or strategy.name}")
    emit(f"Communication Optimization: {'Active' if communication_optimization_active(settings) else 'Inactive'}")
    if settings.enabled:
        emit(f"  {'; '.join(communication_status(settings, None, param_dict)[1])}")
    if config_path is not None:
        emit(f"Training Precision: {precision[0]}")
        if precision[1]:
            emit(f"note: {precision[1]}")
        emit()
        options = _config_options(settings)
        if not options:
            emit("Options selected by the config: none (no heterogeneous block: upstream behaviour)")
        else:
            emit("Options selected by the config:")
        for key, value in options:
            emit(f"  {key}: {value}")
        if model_parameters is not None or settings.memory.enabled:
            emit()
            for line in config_placement_lines(param_dict, settings, rows, model_parameters):
                emit(line)
    if pipeline is not None:
        emit()
        for line in pipeline:
            emit(line)
    for note in settings.notes:
        emit(f"note: {note}")


def main(argv=None):
    """Command line entry point; returns 0, or 2 with a one-line error on stderr for a bad config."""
    parser = argparse.ArgumentParser(description="Report this host's devices for heterogeneous training.")
    parser.add_argument("--config", metavar="PATH", help="ds_config whose heterogeneous blocks to apply")
    parser.add_argument("--model-parameters", metavar="N", help="with --config: the model's parameter count "
                        "(125000000, 1.3e9, 350M, 7B) to show the memory placement the config would get")
    parser.add_argument("--pipeline-stages", metavar="N", help="the pipeline degree of a PipelineModule(num_stages=N) "
                        "(not a ds_config key): show its stages and data-parallel replicas on these devices")
    parser.add_argument("--world-size", metavar="P", help="with --pipeline-stages: the job's processes (default: one "
                        "per heterogeneous_config.emulation entry, else one per device of this host)")
    args = parser.parse_args(argv)
    try:
        count = None if args.model_parameters is None else parse_parameter_count(args.model_parameters)
        stages, processes = args.pipeline_stages, args.world_size
        if stages is not None:
            stages = parse_positive_int("--pipeline-stages", stages, "the number of pipeline stages")
        if processes is not None:
            processes = parse_positive_int("--world-size", processes, "the number of processes")
        heterogeneous_report(args.config, model_parameters=count, pipeline_stages=stages, world_size=processes)
    except ValueError as exc:
        message = " ".join(str(exc).split())
        print(f"{parser.prog}: error: {message}", file=sys.stderr)
        return 2
    return 0


def config_placement_lines(param_dict, settings, rows, num_parameters=None):
    """The env report's placement section for a ds_config on its rows (``(DeviceDescription,
    memory emulated?, speed emulated?)`` per rank, one node); ``num_parameters`` None: a line
    saying the model size is needed."""
    if num_parameters is None:
        return ["Memory Placement: unknown: the config gives no model size; add --model-parameters N"]
    devices = [device for device, _, _ in rows]
    mode = settings.config.mixed_precision_support if settings.enabled else "config"
    decided = dict(param_dict)
    choose_precision_for_config(mode, devices, decided)
    half = get_float16_config(decided).enabled or get_bfloat16_config(decided).enabled
    # Rows whose capacity is emulated are devices apart from the host; a CPU row without emulation
    # has no capacity of its own, so its placement checks nothing either way.
    spec = ModelStateSpec.for_config_dict(param_dict, num_parameters, half, world=len(rows),
                                          emulated_device=any(emulated for _, emulated, _ in rows))
    memory = settings.memory
    # As the runtime counts them (memory/pool.memory_capacities): an emulated capacity, else the
    # device's own; the CPU accelerator's shared host RAM is no rank's limit.
    capacities = [d.memory_bytes if emulated or not d.shared_host_memory else None for d, emulated, _ in rows]
    pool = HeterogeneousMemoryPool(capacities, cpu_memory_limit=memory.cpu_memory_limit_bytes,
                                   hbm_utilization_threshold=memory.hbm_utilization_threshold,
                                   hosts=[0] * len(rows), speeds=known_speeds(devices),
                                   device_names=[d.name for d in devices])
    auto_allowed = memory.enabled or memory.zero_partitions != "auto"
    title = f"Memory Placement ({num_parameters:,} parameters, {'fp16/bf16' if half else 'fp32'}):"
    try:
        engine_placement(pool, spec, memory.zero_partitions if auto_allowed else "even", settings.offload.cpu_offload,
                         settings.offload.nvme_offload)
    except ValueError as exc:
        return [title, f"  refused: {exc}"]
    return [title] + ["  " + line for line in str(pool.report()).splitlines()]


def parse_parameter_count(text):
    """'7e9', '350M', '1.3B', '125k' or digits -> an int; ValueError naming what is allowed."""
    units = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    value = str(text).strip()
    suffix = value[-1:].upper() if value[-1:].isalpha() and value[-1:].upper() in units else ""
    try:
        count = float(value[:-1] if suffix else value) * units[suffix]
    except ValueError:
        count = -1
    if not math.isfinite(count) or count <= 0:
        raise ValueError(f"--model-parameters {text!r} is not a parameter count; write e.g. 125000000, 1.3e9, "
                         "350M or 7B")
    return int(count)


def parse_positive_int(flag, text, meaning):
    """`text` as an int >= 1; ValueError naming `flag` and what it takes."""
    try:
        value = int(str(text).strip())
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{flag} {text!r} is not allowed: give {meaning}, an integer >= 1")
    return value


if __name__ == "__main__":
    sys.exit(main())
