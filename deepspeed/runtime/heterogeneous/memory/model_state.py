# SPDX-License-Identifier: Apache-2.0
"""Per-rank memory limits for the planner (docs/memory.md, "The prediction"), as samples per micro-step.

A rank's predicted peak is the model state its ZeRO shard holds plus the activations of its
micro-batch:

    state_i + base_i + per_sample_i * mbs_i  <=  hbm_utilization_threshold * capacity_i

- ``state_i`` follows ZeRO's accounting: parameters (sharded over the data-parallel ranks in stage
  3), gradients (sharded from stage 2), optimizer states and fp32 master weights (sharded from
  stage 1; nothing on the device when they are offloaded).
- ``base_i + per_sample_i * mbs`` is fitted to the bytes a forward pass saves for backward,
  measured by ``ActivationMeter`` at the sizes the rank ran; the intercept holds what does not
  grow with the batch (workspace, buffers saved once).
- ``capacity_i`` is the device's memory, or the emulated capacity. The CPU accelerator reports
  host RAM, which its ranks share; there a limit comes only from emulation.

Pure logic apart from ``ActivationMeter``, which counts tensors on this process only.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..measure.devices import BYTES_PER_GB

# Optimizer state bytes per parameter, by optimizer class name (lower case). Unknown optimizers
# are assumed to keep two fp32 states, like Adam: over-estimating memory costs throughput,
# under-estimating it costs an out-of-memory error.
_STATE_BYTES = {"sgd": 0, "adagrad": 4, "rmsprop": 4, "lion": 4, "adafactor": 4}
_DEFAULT_STATE_BYTES = 8


def optimizer_state_bytes(optimizer):
    """Bytes of optimizer state per parameter for ``optimizer`` (an instance or a class name)."""
    name = (optimizer if isinstance(optimizer, str) else type(optimizer).__name__).lower()
    for key, size in _STATE_BYTES.items():
        if key in name:
            if key == "sgd" and not isinstance(optimizer, str):
                momentum = any(group.get("momentum", 0) for group in getattr(optimizer, "param_groups", ()))
                return 4 if momentum else 0
            return size
    return _DEFAULT_STATE_BYTES


def model_state_bytes(num_parameters,
                      zero_stage,
                      data_parallel_size,
                      param_bytes=4,
                      optimizer_bytes=_DEFAULT_STATE_BYTES,
                      master_bytes=0,
                      optimizer_offloaded=False,
                      share=None):
    """Model-state bytes one rank holds under ZeRO ``zero_stage`` (0-3).

    Args:
        num_parameters: trainable parameters of the whole model.
        param_bytes: bytes per parameter (and gradient) in the training dtype.
        optimizer_bytes: optimizer state bytes per parameter (Adam: 8).
        master_bytes: fp32 master copy per parameter under fp16/bf16 (4), else 0 (ZeRO 1-3 count 4
            whatever it says: they always update an fp32 copy of their partition).
        optimizer_offloaded: optimizer states and master weights live on the host: True, or the part of
            them that does (a ZeRO-3 ``offload_optimizer.ratio``).
        share: this rank's share of the ZeRO-1/2/3 partitioned state (``partitions.py``,
            ``zero3_shards.py``); None: 1/N.
    """
    parts = model_state_parts(num_parameters, zero_stage, data_parallel_size, param_bytes, optimizer_bytes,
                              master_bytes, share)
    kept = 1.0 - min(1.0, max(0.0, float(optimizer_offloaded)))
    return int(math.ceil(parts.parameters + parts.gradients + kept * parts.optimizer))


class ModelStateParts(NamedTuple):
    """One rank's model state by kind (bytes, unrounded); ``optimizer`` counts the fp32 master copy."""

    parameters: float
    gradients: float
    optimizer: float


def model_state_parts(num_parameters, zero_stage, data_parallel_size, param_bytes=4,
                      optimizer_bytes=_DEFAULT_STATE_BYTES, master_bytes=0, share=None):
    """``model_state_bytes`` by kind, wherever each kind lives (the memory pool places them)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage!r} must be 0, 1, 2 or 3")
    world = max(1, int(data_parallel_size))
    part = 1.0 / world if share is None or zero_stage == 0 else float(share)
    # ZeRO 1-3 keep their own fp32 copy of the partition they update, in fp32 training too.
    master_bytes = max(master_bytes, 4) if zero_stage >= 1 else master_bytes
    return ModelStateParts(parameters=num_parameters * param_bytes * (part if zero_stage >= 3 else 1),
                           gradients=num_parameters * param_bytes * (part if zero_stage >= 2 else 1),
                           optimizer=num_parameters * (optimizer_bytes + master_bytes) *
                           (part if zero_stage >= 1 else 1))


def model_state_inputs(parameters, half, optimizer, optimizer_offloaded):
    params = [p for p in parameters if p.requires_grad]
    return {
        # A ZeRO-3 partitioned parameter's numel() is its local shard; ds_numel is the whole.
        "num_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in params),
        "param_bytes": 2 if half else 4,
        "optimizer_bytes": optimizer_state_bytes(optimizer),
        "master_bytes": 4 if half else 0,
        "optimizer_offloaded": float(optimizer_offloaded),
    }


def zero3_sub_groups(group_numels, world, sub_group_size):
    """Each ZeRO-3 optimizer sub-group's fraction of a rank's partitioned state, formed as upstream
    forms them (``DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups``): per parameter group, a
    rank's partitions (ceil(numel / world) elements each) in order, a sub-group closing once it
    holds ``sub_group_size`` elements or at the group's last parameter. ``group_numels``: per
    parameter group, the trainable parameters' full sizes. None for a model without parameters."""
    sizes = []
    for numels in group_numels:
        parts = [-(-int(n) // max(1, int(world))) for n in numels]
        if not parts:
            continue
        if sub_group_size is None or sub_group_size >= sum(parts):
            sizes.append(sum(parts))
            continue
        held = 0
        for index, part in enumerate(parts):
            held += part
            if held >= sub_group_size or index == len(parts) - 1:
                sizes.append(held)
                held = 0
    total = sum(sizes)
    return tuple(size / total for size in sizes) if total else None


def model_sub_groups(ds_config, model, optimizer=None):
    """``zero3_sub_groups`` of ``model`` under a ``DeepSpeedConfig``: the client optimizer's
    parameter groups (an instance), else one group of the model's parameters."""
    groups = optimizer.param_groups if isinstance(optimizer, torch.optim.Optimizer) else [{
        "params": list(model.parameters())
    }]
    numels = [[getattr(p, "ds_numel", p.numel()) for p in group["params"] if p.requires_grad] for group in groups]
    return zero3_sub_groups(numels, int(ds_config.world_size), ds_config.zero_config.sub_group_size)


def offloaded_fraction(zero_config, sub_groups=None):
    """The part of a rank's optimizer state ``zero_optimization.offload_optimizer`` moves off the
    device: 0, 1, or under ZeRO-3's ``ratio`` < 1 the last sub-groups' part (``sub_groups``: each
    one's fraction, ``zero3_sub_groups``), upstream keeping the first ``int((1 - ratio) * n)`` on the
    device; the ratio itself when the sub-groups are unknown."""
    offload = zero_config.offload_optimizer
    if offload is None or str(getattr(offload.device, "value", offload.device)) not in ("cpu", "nvme"):
        return 0.0
    ratio = float(offload.ratio)
    if int(zero_config.stage) != 3 or ratio >= 1.0:
        return 1.0
    if not sub_groups:
        return ratio
    return float(sum(sub_groups[int((1 - ratio) * len(sub_groups)):]))


def engine_model_state_inputs(engine):
    """What ``model_state_bytes`` needs to know of ``engine`` besides the ZeRO stage and the
    data-parallel size (the autotuner re-evaluates other stages and sizes from these)."""
    optimizer = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    return model_state_inputs(engine.module.parameters(), engine.fp16_enabled() or engine.bfloat16_enabled(),
                               optimizer, offloaded_fraction(engine._config.zero_config, engine_sub_groups(engine)))


def engine_sub_groups(engine):
    """A built ZeRO-3 optimizer's sub-groups, each one's fraction of the rank's partitioned state
    (None for other stages)."""
    numels = getattr(engine.optimizer, "fp16_partitioned_groups_flat_numel", None)
    return tuple(n / sum(numels) for n in numels) if numels and sum(numels) else None


@dataclass(frozen=True)
class ActivationModel:
    """Activation bytes of one micro-step: ``base + per_sample * mbs``."""

    base: float
    per_sample: float

    def bytes_for(self, micro_batch_size):
        return self.base + self.per_sample * micro_batch_size


def fit_activation_model(samples):
    """Fit ``bytes = base + per_sample * mbs`` to ``[(mbs, bytes), ...]``.

    One size only: ``base = 0`` and the bytes scale with the batch (the safe side). The fit is
    clamped to ``base >= 0`` and ``per_sample > 0``.
    """
    points = [(float(m), float(b)) for m, b in samples if m > 0]
    if not points:
        raise ValueError("fit_activation_model needs at least one (micro_batch_size > 0, bytes) sample")
    sizes = {m for m, _ in points}
    if len(sizes) == 1:
        size = next(iter(sizes))
        return ActivationModel(0.0, max(max(b for _, b in points) / size, 1.0))
    n = len(points)
    mean_m = sum(m for m, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    slope = sum((m - mean_m) * (b - mean_b) for m, b in points) / sum((m - mean_m)**2 for m, _ in points)
    slope = max(slope, 1.0)
    base = max(mean_b - slope * mean_m, 0.0)
    # Clamping the intercept must not let the model predict less than was measured.
    slope = max(slope, max((b - base) / m for m, b in points))
    return ActivationModel(base, slope)


class RankCannotFitError(ValueError):
    """A rank's memory cannot hold even one sample."""


def max_micro_batch(capacity_bytes, state_bytes, activations, utilization=1.0, rank_label="rank"):
    """Largest micro-batch that fits, or None without a capacity (no limit).

    Raises RankCannotFitError naming the rank and the bytes when not even one sample fits.
    """
    if capacity_bytes is None:
        return None
    budget = capacity_bytes * utilization
    room = budget - state_bytes - activations.base
    samples = int(room // activations.per_sample) if room > 0 else 0
    if samples < 1:
        raise RankCannotFitError(
            f"{rank_label} cannot hold one sample: model state {_gib(state_bytes)} + activations "
            f"{_gib(activations.base)} + {_gib(activations.per_sample)} per sample exceed "
            f"{utilization:.0%} of its {_gib(capacity_bytes)} (heterogeneous_memory.hbm_utilization_threshold); "
            f"offload optimizer states, use a higher ZeRO stage, or give the rank more memory")
    return samples


def startup_memory_limits(capacities, state_bytes, utilization, samples_per_micro_step, rank_labels=None,
                          unlimited_bytes=None):
    """Per-rank micro-batch limits for the first step, before any activation was measured (None
    entries: no limit known).

    A sample's activation bytes are not known until a forward saved them, and a limit set from
    outside (a job scheduler's, a smaller GPU) may not hold the equal split a user sized the batch
    for: upstream would be killed there. The estimate assumes only that the micro-step fits the
    ranks' memory together: a sample takes the total room over the samples, where a rank's room is
    ``capacity * utilization - state`` and a rank without a known limit counts with
    ``unlimited_bytes`` (the memory it may use: its host's RAM over the ranks sharing it), or with
    the largest known room when that is not given. Each rank with a known limit may then hold its
    room's proportion of the micro-step (at least one sample; the remainders rounded so that the
    limits add up to the micro-step). Equal rooms give equal limits. The first profiling step
    measures the activations and replaces these limits (``profiling.memory_limits``).

    Raises RankCannotFitError naming a rank whose model state alone exceeds its budget.
    """
    world = len(capacities)
    samples = int(samples_per_micro_step)
    labels = rank_labels or [f"data-parallel rank {rank}" for rank in range(world)]
    rooms = {}
    for rank, (capacity, state) in enumerate(zip(capacities, state_bytes)):
        if capacity is None:
            continue
        rooms[rank] = capacity * utilization - state
        if rooms[rank] <= 0:
            raise RankCannotFitError(
                f"{labels[rank]} cannot hold its model state {_gib(state)} within {utilization:.0%} of its "
                f"{_gib(capacity)} (heterogeneous_memory.hbm_utilization_threshold); offload optimizer states, use "
                f"a higher ZeRO stage, or give the rank more memory")
    if not rooms:
        return [None] * world
    unknown = [rank for rank in range(world) if capacities[rank] is None]
    others = [max(float(unlimited_bytes[rank]) - state_bytes[rank], 0.0) if unlimited_bytes else max(rooms.values())
              for rank in unknown]
    total = math.fsum(rooms.values()) + math.fsum(others)
    fractions = {rank: samples * room / total for rank, room in rooms.items()}
    limits = {rank: max(1, int(fraction)) for rank, fraction in fractions.items()}
    if not unknown:  # the limits must leave room for the whole micro-step
        short = samples - sum(limits.values())
        for rank in sorted(rooms, key=lambda r: (-(fractions[r] - int(fractions[r])), r))[:max(short, 0)]:
            limits[rank] += 1
    return [limits.get(rank) for rank in range(world)]


def _gib(size):
    return f"{size / BYTES_PER_GB:.4g} GiB"


class ActivationMeter:
    """The activation bytes of a micro-step at their peak: the tensors autograd saves for backward
    while the meter is on, plus the largest of them once more, its gradient in flight (backward
    holds an op's output gradient while it produces the input's; measured on a CPU rank in a memory
    cgroup, that tensor was what the peak held beyond the saved ones, 4% of it for an MLP whose
    hidden activations are 16x its width).

    Parameters saved by their layers are model state, not activations, and are not counted; a
    storage saved twice (a view and its base) counts once. ``start()``/``stop()`` instead of a
    ``with`` block because the engine's hooks sit at the two ends of a forward pass; ``stop()`` is
    safe to call when the meter is off.
    """

    def __init__(self):
        self._hooks = None
        self._storages = {}

    @property
    def active(self):
        return self._hooks is not None

    def start(self):
        self.stop()
        self._storages = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()

    def stop(self):
        """Turn the meter off; returns the bytes counted since ``start()`` (0 when it was off)."""
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        saved, self._storages = list(self._storages.values()), {}
        return sum(saved) + max(saved, default=0)

    def _pack(self, tensor):
        # A layer saves its weight itself or a view of it (linear saves weight.t()).
        weight = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
        if not weight and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            self._storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
        return tensor


def _unpack(tensor):
    return tensor
