# SPDX-License-Identifier: Apache-2.0
"""Which data-parallel replica this process is, and every replica's device: the two facts the
start-up plan needs from the cluster, derived once per engine (``state.dp_rank``,
``state.devices``)."""

from dataclasses import replace

from deepspeed import comm as dist

from .agreement import Agreement, by_replica
from ..measure.devices import DeviceDescription, describe_local_device, emulated_memory_bytes, local_device_index


def data_parallel_rank(mpu=None, mesh_device=None, world_size=None, sequence_parallel_size=None):
    """This process's data-parallel rank: which of the ``world_size`` replicas that
    ``DeepSpeedConfig`` counts it belongs to. Derived here once (``state.dp_rank``); the plan, the
    loss weight and the training loader all use it.

    It follows the grouping the engine reduces gradients over
    (``groups._get_sequence_data_parallel_group``, divided by the replica count): an mpu's own
    data-parallel rank; with a sequence-parallel mpu (Ulysses, which has no data-parallel calls) the
    sequence-parallel groups are consecutive ranks of the sequence-data-parallel group, so the
    replica is that rank divided by the sequence-parallel size (its members split the same samples'
    sequences, as model-parallel members split the model); with a device mesh, the rank in its
    "data_parallel" dimension; otherwise the global rank.

    Args:
        world_size: the data-parallel world size the config counts; checked against, when given.
        sequence_parallel_size: the config's top-level ``sequence_parallel_size`` (used only to
            refuse it without an mpu or a mesh, which leaves the replicas unknown).
    """
    if mpu is not None and hasattr(mpu, "get_data_parallel_rank"):
        rank = mpu.get_data_parallel_rank()
    elif mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        rank = mpu.get_sequence_data_parallel_rank() // mpu.get_sequence_parallel_world_size()
    elif mesh_device is not None:
        rank = dist.get_rank(group=mesh_device.get_group(mesh_dim="data_parallel"))
    elif sequence_parallel_size not in (None, 1):
        raise ValueError(f"heterogeneous_config with sequence_parallel_size {sequence_parallel_size} needs the "
                         "sequence-parallel groups: pass the mpu (deepspeed.initialize(mpu=...)) or give "
                         "data_parallel_size too (a device mesh), so that each rank's replica is known")
    else:
        rank = dist.get_rank() if dist.is_initialized() else 0
    rank = int(rank)
    if world_size is not None and not 0 <= rank < int(world_size):
        raise ValueError(f"deepspeed-hetero: data-parallel rank {rank} is out of range for the data-parallel world "
                         f"size {world_size} the config counts; the mpu / mesh and the config disagree")
    return rank


def gather_devices(dp_rank, world_size, memory_bytes=None):
    """Every data-parallel rank's DeviceDescription, in data-parallel rank order; ``memory_bytes``
    replaces this rank's real capacity (emulated clusters).

    All processes take part, so that the model-parallel members of a replica agree: a replica is
    described by its slowest member's device, with its smallest memory.
    """
    # Unknown devices are not benchmarked here: the profiling steps measure the real workload.
    mine = describe_local_device(local_rank=local_device_index(), memory_bytes=memory_bytes, measure=False).to_dict()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [DeviceDescription.from_dict(mine)]
    gathered = Agreement(f"data-parallel rank {dp_rank}").gather_from_every_rank((dp_rank, mine),
                                                                               "every rank's device")
    devices, groups = [], by_replica(gathered)
    for rank in range(world_size):
        members = [DeviceDescription.from_dict(d) for d in groups.get(rank, ())]
        slowest = min(members, key=lambda d: (d.spec_score, d.rank))
        devices.append(replace(slowest, memory_bytes=min(d.memory_bytes for d in members)))
    return devices


def _needs_devices(settings):
    config = settings.config
    return (config.strategy.adapts or isinstance(config.micro_batch_sizes, dict)
            or _emulated_memory_gb(settings) is not None or config.mixed_precision_support != "config"
            or settings.memory.enabled)  # the memory pool places by each rank's capacity


def gather_local_devices(settings, dp_rank, world_size, emulated_rank=None):
    """``gather_devices`` when a decision needs the devices (None otherwise), with this process's
    emulated memory (entry ``emulated_rank``, default ``dp_rank``) in place of its real capacity."""
    if not _needs_devices(settings):
        return None
    index = dp_rank if emulated_rank is None else emulated_rank
    return gather_devices(dp_rank, world_size, emulated_memory_bytes(settings.config.emulation, index))



def _emulated_memory_gb(settings):
    emulation = settings.config.emulation
    return emulation.memory_gb if emulation is not None and emulation.memory_gb else None


ACCELERATE_PROCESSES = "accelerate.num_processes"
"""The settings-summary key under which each rank reports the process count Hugging Face
accelerate set itself up for (``accelerate_process_count``), so that the ranks compare it."""


def accelerate_process_count():
    """The number of processes Hugging Face accelerate's state (which transformers'
    ``TrainingArguments`` and ``accelerate launch`` set up) counts in this process, or None where
    accelerate is not in use. Read, never imported: a run without accelerate pays nothing."""
    import sys
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "PartialState", None), "_shared_state", None) or {}
    count = shared.get("num_processes")
    return int(count) if count is not None else None


def accelerate_world_problem(count, world_size, accelerator_name, param_dict=None):
    """``(error, message)`` where accelerate counted another number of processes than the job has,
    else ``(False, None)``.

    On a machine without a GPU, ``TrainingArguments`` without ``use_cpu=True`` (and
    ``Accelerator()`` without ``cpu=True``, as ``accelerate launch`` without ``--cpu`` starts it)
    leaves accelerate with no backend: it counts one process and shards no data loader. Where the
    config's batch was sized for that count (``train_batch_size`` = micro-batch x gas x count: the
    Trainer fills it so) the ranks would be fed the wrong number of samples: an error. Otherwise
    the job runs, but every rank iterates the whole of a loader accelerate prepared: a warning."""
    if count is None or count == world_size:
        return False, None
    fix = ("pass TrainingArguments(use_cpu=True) or Accelerator(cpu=True) (or set ACCELERATE_USE_CPU=1): without "
           "it, on a machine without a GPU, accelerate finds no distributed backend and counts one process"
           if accelerator_name == "cpu" else "launch every rank through the same launcher accelerate was set up for")
    batch = [(param_dict or {}).get(key) for key in
             ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    sized_for_count = all(isinstance(v, int) for v in batch) and batch[0] == batch[1] * batch[2] * count
    if sized_for_count:
        return True, (f"deepspeed-hetero: transformers/accelerate set this job up for {count} process(es), but "
                      f"{world_size} ranks run it, and sized the global batch for {count} (train_batch_size "
                      f"{batch[0]}); {fix}")
    return False, (f"deepspeed-hetero: accelerate set this job up for {count} process(es), but {world_size} ranks "
                   f"run it: a data loader it prepares is not sharded across the ranks, so every rank iterates "
                   f"all of it; {fix}, or shard the loader yourself")
