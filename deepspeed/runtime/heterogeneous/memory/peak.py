# SPDX-License-Identifier: Apache-2.0
"""What DeepSpeed 0.19.8 allocates on one rank, phase by phase, and the peak it reaches
(docs/memory.md). Pure: byte arithmetic from sizes and settings, no tensors, no collectives.

The model-state count of ``model_state.model_state_parts`` (parameters, gradients, optimizer state
and master copy of a rank's ZeRO share) is what a rank *keeps*. A rank dies at what it holds at its
busiest moment, which adds the buffers upstream allocates around those states. Each phase below
lists the allocations that are alive together at the moment the phase peaks, named after the
upstream code that makes them:

- ``initialize``: the flat copy of the parameters (ZeRO-1/2 ``bit16_groups_flat``, built with
  ``torch.cat`` while the original tensors are still alive; the originals' memory is not given
  back to the device: a caching allocator keeps it, and on the host the allocator keeps it too),
  the fp32 partition (``single_partition_of_fp32_groups``, a clone even in fp32 training) and
  ZeRO-3's flat partitions.
- ``backward``: the gradients as autograd leaves them (ZeRO-0/1: every parameter's; ZeRO-2/3: the
  partition, ``grads_in_partition``, plus the reduce bucket ``reduce_bucket_size`` elements, twice
  with ``overlap_comm``, of which the model fills at most its own size), the all-reduce buffer of
  ZeRO-0 (``buffered_allreduce_fallback`` flattens up to 5e8 elements), and the optimizer state
  created at the first step, which is alive from then on.
- ``step``: the fp32 gradient partition handed to the optimizer (ZeRO-1/2
  ``single_grad_partition``, a new flat tensor) and the optimizer's temporaries: torch's Adam
  computes ``exp_avg_sq.sqrt() / bias_correction`` as two new tensors of each parameter's size;
  its single-tensor loop (host tensors) holds them for the largest tensor it steps, its ``foreach``
  path (device tensors) for the whole group. ZeRO-1/2 step one flat partition, so there the
  largest tensor is the partition.
- ZeRO-3 gathers whole parameters for the forward and the backward, the frozen ones too (a LoRA
  model's base); with upstream's defaults (``stage3_max_live_parameters`` 1e9,
  ``stage3_prefetch_bucket_size`` 5e7) a model below those sizes is fully gathered at once. A
  prefetch bucket is all-gathered into one flat tensor and each parameter then copied out of it
  (``AllGatherCoalescedHandle.wait``: ``torch.cat`` of its slices); the flat tensor lives until the
  last parameter of its bucket is fetched, so a bucket is held twice while the model runs
  (measured on the host: a 21 MB GPT-2 gathered into 38-39 MB). Once the first step has traced
  the modules, a parameter used again within ``stage3_max_reuse_distance`` elements (1e9) is not
  released after the forward,
  whatever the live-parameter budget: every parameter of a model below it stays gathered until its
  backward (measured: a rank holding 6% of a 28M-parameter MLP at ``stage3_max_live_parameters``
  2e6 held 90 MB of gathered parameters from the second forward on).

``PeakPrediction.phases`` gives every allocation by name, so a report can say which one sets the
peak. Activations come from the fork's activation meter (``memory.ActivationMeter``) and are
added to the forward and backward phases.
"""

from dataclasses import dataclass
from typing import Dict

from .zero3_shards import CHUNKS_IN_FLIGHT, REFRESH_CHUNK_BYTES

# Upstream defaults that size buffers (deepspeed/runtime/zero/config.py, engine.py).
ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # engine.allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
ADAM_TEMPORARIES = 2  # exp_avg_sq.sqrt(), then its division: two tensors of the stepped tensor's size


@dataclass(frozen=True)
class ZeroAllocations:
    """What sizes DeepSpeed's allocations on one rank, besides its share.

    Args:
        num_parameters: trainable parameters of the whole model (elements).
        largest_parameter: elements of the largest trainable parameter.
        frozen_parameters: the model's parameters that are not trained (elements; a LoRA model's
            base): no gradient or optimizer state, but ZeRO-3 gathers them as it gathers the
            trained ones, and the engine moves and converts them with the module. Where they are
            already in the rank's memory (whole, or the slices ``zero.Init`` cut) the baseline holds them.
        zero_stage: 0-3.
        world: data-parallel ranks.
        param_bytes: bytes per element of parameters and gradients in the training dtype.
        optimizer_bytes: optimizer state per element (Adam 8, SGD 0 or 4 with momentum).
        optimizer_temporaries: tensors of the stepped tensor's size the optimizer's step allocates
            (torch Adam 2; SGD 0; DeepSpeed's fused/CPU Adam 0: they update in place).
        master_bytes: the fp32 master copy ZeRO-0 keeps under fp16/bf16 (4), else 0; ZeRO 1-3
            always keep 4.
        reduce_bucket: ``zero_optimization.reduce_bucket_size`` (elements).
        allgather_bucket: ``zero_optimization.allgather_bucket_size`` (elements).
        overlap_comm: ``zero_optimization.overlap_comm`` as upstream resolves it (ZeRO-3 on).
        contiguous_gradients: ``zero_optimization.contiguous_gradients``.
        max_live_parameters: ZeRO-3 ``stage3_max_live_parameters`` (elements).
        prefetch_bucket: ZeRO-3 ``stage3_prefetch_bucket_size`` (elements).
        max_reuse_distance: ZeRO-3 ``stage3_max_reuse_distance`` (elements).
        sub_group_size: ZeRO-3 ``sub_group_size`` (elements): the optimizer steps one at a time.
        foreach: whether the optimizer steps a group at once (device tensors) or tensor by tensor
            (host tensors: torch chooses the single-tensor loop on the CPU).
        host_is_device: the device is host memory (the CPU accelerator): state offloaded "to the
            host" stays in the rank's memory.
        parameters_resident: the module's parameters are already in the rank's memory when the
            engine starts (counted in the baseline); else the engine moves them there.
        converted: the engine converts the module to the training dtype (fp32 parameters, fp16/bf16
            training): new tensors.
    """

    num_parameters: int
    largest_parameter: int
    zero_stage: int
    world: int = 1
    param_bytes: int = 4
    optimizer_bytes: int = 8
    optimizer_temporaries: int = ADAM_TEMPORARIES
    master_bytes: int = 0
    reduce_bucket: int = 500_000_000
    allgather_bucket: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    max_live_parameters: int = 1_000_000_000
    prefetch_bucket: int = 50_000_000
    max_reuse_distance: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    foreach: bool = False
    host_is_device: bool = False
    parameters_resident: bool = True
    converted: bool = False
    frozen_parameters: int = 0
    overlap_buckets: int = 0
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step. ZeRO-2 keeps the gradients accumulated over the earlier
    micro-steps (``all_grad_tensors``: the rank's partition, in the gradient accumulation dtype)
    through the next micro-step's forward and backward, beside the new partition that backward fills
    (measured: bench_plan_accuracy.py's ZeRO-2 row at gas 2 held one more partition than counted)."""
    """ZeRO-1/2/3 buckets the overlap worker holds at once (``communication.overlap`` in force:
    ``comm/overlap.DEPTH``; 0 without it), each twice: the set-aside bucket and the copy it reduces."""

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage {self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.num_parameters < 0 or self.largest_parameter < 0 or self.frozen_parameters < 0 or self.world < 1:
            raise ValueError(f"num_parameters {self.num_parameters}, largest_parameter {self.largest_parameter}, "
                             f"frozen_parameters {self.frozen_parameters} and world {self.world} must be >= 0, >= 0, "
                             ">= 0 and >= 1")


@dataclass(frozen=True)
class PeakPrediction:
    """A rank's predicted bytes per phase (each a dict of named allocations) and its peak."""

    phases: Dict[str, Dict[str, float]]
    baseline_bytes: float = 0.0
    """In use before the engine started (``meter.current_bytes``); part of every phase."""
    activation_bytes: float = 0.0

    def phase_bytes(self, phase):
        return self.baseline_bytes + sum(self.phases[phase].values())

    @property
    def peak_phase(self):
        return max(self.phases, key=self.phase_bytes)

    @property
    def peak_bytes(self):
        return int(self.phase_bytes(self.peak_phase))

    @property
    def buffer_bytes(self):
        """What the peak phase holds beyond the kept model state and activations: DeepSpeed's
        buffers and temporaries (what ``model_state.model_state_bytes`` leaves out)."""
        return sum(v for k, v in self.phases[self.peak_phase].items() if k not in _KEPT)

    def describe(self):
        allocations = ", ".join(f"{name} {_mib(size)}" for name, size in self.phases[self.peak_phase].items() if size)
        return f"{_mib(self.peak_bytes)} at {self.peak_phase} ({_mib(self.baseline_bytes)} in use at start + " \
               f"{allocations})"


# Allocations that are model state kept between steps (the pool's parameters / gradients / optimizer).
_KEPT = ("parameters", "gradients", "gradient partition", "fp32 partition", "optimizer state", "activations",
         "accumulated gradients")


def predict_peak(allocations, share=None, offloaded=0.0, activation_bytes=0.0, baseline_bytes=0.0,
                 largest_share=None, host_shard=0.0, hosts=1):
    """The phases of one rank under ``allocations`` (``ZeroAllocations``) and its peak.

    Args:
        share: the rank's part of the partitioned ZeRO-1/2/3 state (None: 1/world).
        offloaded: part of the optimizer state (and master copy) off the device (ZeRO-Offload).
        activation_bytes: what the forward saves for backward at the rank's micro-batch.
        baseline_bytes: in use when the engine started.
        largest_share: the largest rank's share (None: even shares, or this rank's when larger):
            in ZeRO-1/2 every rank flattens each owner's slice of a bucket to reduce it; in ZeRO-3
            the uneven gathers and reduce-scatters pad every rank's slice of a bucket to the largest
            (``zero3_shards.py``).
        host_shard: ZeRO-3: the fraction of the model this rank keeps as its host shard
            (``comm/host_shards.py``: its share over its host's), 0 without host shards.
        hosts: ZeRO-3 with host shards: the number of hosts (the refresh sends each element of the
            rank's partition once to every host, a few chunks at a time).
    """
    a = allocations
    n, pb = float(a.num_parameters), float(a.param_bytes)
    world = a.world
    stage = a.zero_stage
    part = (1.0 / world if share is None else float(share)) if stage >= 1 else 1.0
    kept = 1.0 if a.host_is_device else 1.0 - min(1.0, max(0.0, float(offloaded)))
    master = 4.0 if stage >= 1 else float(a.master_bytes)
    whole = n + float(a.frozen_parameters)  # every parameter of the module, trained or not
    moved_in = 0.0 if a.parameters_resident else whole * pb  # the engine moves the module to the device

    if stage == 0:
        # Under fp16/bf16 the engine converts the module (new tensors of the training dtype unless the
        # client converted it), and the fp16 optimizer keeps an fp32 master copy and steps fp32
        # copies of the gradients.
        params = moved_in + (whole * pb if a.converted else 0.0)
        master_copy = n * master
        optimizer = n * a.optimizer_bytes
        grads = n * pb
        stepped = n if a.foreach else float(a.largest_parameter)
        temporaries = a.optimizer_temporaries * stepped * 4.0
        allreduce = min(ALLREDUCE_BUCKET_ELEMENTS, n) * pb
        kept = {"parameters": params, "fp32 partition": master_copy}
        phases = {
            "initialize": dict(kept),
            "forward": {**kept, "optimizer state": optimizer, "activations": activation_bytes},
            # Autograd frees the activations as it produces the gradients; the all-reduce follows.
            "backward": {**kept, "optimizer state": optimizer, "activations": activation_bytes, "gradients": grads},
            "reduce": {**kept, "optimizer state": optimizer, "gradients": grads, "all-reduce buffer": allreduce},
            "step": {**kept, "optimizer state": optimizer, "gradients": grads,
                     "fp32 gradients": n * 4.0 if master else 0.0, "optimizer temporaries": temporaries},
        }
        return PeakPrediction(phases, float(baseline_bytes), float(activation_bytes))

    if stage in (1, 2):
        flat = n * pb  # bit16_groups_flat; the originals' memory stays with the allocator
        fp32_partition = part * n * master * kept
        optimizer = part * n * a.optimizer_bytes * kept
        bucket = min(a.reduce_bucket, n) * pb * (2 if a.overlap_comm else 1) if a.contiguous_gradients else 0.0
        # ZeRO-2 reduces into its partition as buckets fill; ZeRO-1 only at the accumulation
        # boundary, when every parameter's gradient exists: each is copied into the bucket and freed
        # in turn, so the whole gradients and the bucket together never pass the model's size.
        grads = {"gradient partition": part * n * pb, "gradient in flight": a.largest_parameter * pb}
        if stage == 1:
            grads["gradients"] = max(n * pb - bucket, 0.0)
        grad_for_step = part * n * 4.0 * kept  # single_grad_partition (fp32)
        # ZeRO-2 at gas > 1: the partition accumulated over the earlier micro-steps (not under offload,
        # which accumulates into the fp32 partition's gradient).
        accumulated = (part * n * pb if stage == 2 and a.gradient_accumulation_steps > 1 and offloaded <= 0
                       else 0.0)
        stepped = part * n  # one flat partition
        temporaries = a.optimizer_temporaries * stepped * 4.0 * kept
        # average_tensor reduces each owner's slice of the bucket through allreduce_bucket, which
        # flattens it first: one slice at a time on every rank, the largest owner's at the peak.
        slice_copy = min(a.reduce_bucket, n) * pb * max(part, 1.0 / world, float(largest_share or 0.0))
        # The updated partitions are all-gathered into the flat parameters in allgather_bucket_size
        # pieces; a host backend (gloo) stages a piece's gathered output before copying it out.
        # Uneven shares are broadcast by their owners into the flat parameters in place
        # (partitions.gather_uneven_partitions): nothing is staged.
        uneven = largest_share is not None and float(largest_share) > 1.0 / world + 1e-9
        staging = min(a.allgather_bucket, n) * pb if a.host_is_device and not uneven else 0.0
        params = {"parameters": flat + moved_in}
        state = {"fp32 partition": fp32_partition, "optimizer state": optimizer}
        if offloaded > 0:
            # The cpu_offload path: the fp32 partition's gradient is kept (gradients are copied into
            # it, no grads_in_partition, no flattening at the step), a bit16 copy of the partition
            # for the parameters' way back, two gradient buffers of the largest parameter, and
            # DeepSpeedCPUAdam, which updates in place. Only the host's part counts on a device.
            host = 1.0 if a.host_is_device else 0.0
            state.update({"fp32 gradient partition": part * n * 4.0 * host,
                          "bit16 partition copy": part * n * pb * host,
                          "offload gradient buffers": 2 * a.largest_parameter * pb})
            grads = {"gradient in flight": a.largest_parameter * pb}
            grad_for_step, temporaries = 0.0, 0.0
        kept_grads = {k: v for k, v in grads.items() if k != "gradient in flight"}
        pending = _overlap_pending(a, n, pb, contiguous=a.contiguous_gradients)
        phases = {
            # initialize_optimizer_states hands the optimizer a zero gradient partition first.
            "initialize": {**params, "fp32 partition": fp32_partition, "initial gradient partition": part * n * 4.0},
            "forward": {**params, **state, "activations": activation_bytes, "accumulated gradients": accumulated},
            # A bucket the model fills only at its end (ZeRO-2) and ZeRO-1's reduce at the boundary come
            # once autograd has freed the activations; a smaller ZeRO-2 bucket reduces while they live.
            "backward": {**params, **state, "activations": activation_bytes, **grads, **pending,
                         "accumulated gradients": accumulated,
                         **({"reduce bucket": bucket, "reduced slice copy": slice_copy}
                            if stage == 2 and a.reduce_bucket < n else {})},
            "reduce": {**params, **state, **grads, "reduce bucket": bucket, "reduced slice copy": slice_copy,
                       "accumulated gradients": accumulated},
            "step": {**params, **state, **kept_grads, "fp32 gradient partition": grad_for_step,
                     "optimizer temporaries": temporaries},
            "all-gather": {**params, **state, **kept_grads, "all-gather staging": staging},
        }
        return PeakPrediction(phases, float(baseline_bytes), float(activation_bytes))

    # ZeRO-3: partitioned parameters (this rank's share), whole ones gathered for forward and backward;
    # with uneven shares each gathered or reduced bucket is padded to the largest share on every rank.
    padding = max(1.0, world * max(part, float(largest_share or 0.0)))
    partition = n * pb * part
    # Each gathered parameter whole, beside the flat tensor of a prefetch bucket (padded) it was copied from.
    gathered = (min(whole, float(max(a.max_live_parameters, a.prefetch_bucket, a.max_reuse_distance))) +
                min(whole, float(a.prefetch_bucket)) * padding) * pb
    fp32_partition = n * master * part * kept
    optimizer = n * a.optimizer_bytes * part * kept
    grad_partition = n * 4.0 * part  # fp32 gradient partition the optimizer steps
    # Upstream's ZeRO-3 keeps one reduce bucket per dtype (``ipg_buckets``), ``reduce_bucket_size``
    # elements of ``torch.empty``; on the host only the pages the gradients fill are touched (measured:
    # no second bucket under overlap_comm). On a device the doubled count stays, an upper bound.
    bucket = min(a.reduce_bucket, n) * pb * (2 if a.overlap_comm and not a.host_is_device else 1) * padding
    # ZeRO-3 steps each flat optimizer sub-group as one tensor.
    stepped = min(n * part, float(a.sub_group_size))
    temporaries = a.optimizer_temporaries * stepped * 4.0 * kept
    state = {"parameters": partition + moved_in, "fp32 partition": fp32_partition, "optimizer state": optimizer}
    if offloaded > 0 and a.host_is_device:
        # Upstream gives each offloaded sub-group an fp32 gradient buffer of its own
        # (initialize_optimizer_states: ``subgroup_gradient_buffer``, zeroed) beside the gradient
        # partition, kept from start-up; it lives on the host, so only there is it the rank's memory.
        state["offloaded fp32 gradients"] = n * 4.0 * part * min(1.0, float(offloaded))
    refresh = {}
    if host_shard:
        state["host shard"] = n * pb * float(host_shard)
        # The refresh after a step runs in chunks during the forward's first gathers: at most
        # CHUNKS_IN_FLIGHT chunks, each under REFRESH_CHUNK_BYTES plus one parameter, with the rank's
        # primary part packed once per host and what arrives for its host shard. An upper bound:
        # every chunk may end in a parameter as large as the largest, and the buffers are counted
        # beside the whole forward's activations though they are freed as the forward goes on.
        chunk = REFRESH_CHUNK_BYTES + float(a.largest_parameter) * pb
        in_flight = min(n * pb, CHUNKS_IN_FLIGHT * chunk)
        refresh = {"refresh buffers": in_flight * (part * max(1, int(hosts)) + float(host_shard))}
    phases = {
        "initialize": {"parameters": partition + moved_in + n * pb, "fp32 partition": fp32_partition},
        "forward": {**state, "gathered parameters": gathered, "activations": activation_bytes, **refresh},
        "backward": {**state, "gathered parameters": gathered, "activations": activation_bytes,
                     "gradient partition": grad_partition, "reduce bucket": bucket,
                     **_overlap_pending(a, n, pb, padding)},
        # The step flattens each sub-group's gradient partition into a new fp32 tensor
        # (_prepare_fp32_grad_for_sub_group) beside the partition it copies.
        "step": {**state, "gradient partition": grad_partition, "flattened sub-group gradient": stepped * 4.0 * kept,
                 "optimizer temporaries": temporaries},
    }
    return PeakPrediction(phases, float(baseline_bytes), float(activation_bytes))


def _overlap_pending(a, n, pb, padding=1.0, contiguous=True):
    """The overlap worker's buckets during the backward (``comm/overlap.py``): up to
    ``overlap_buckets`` set aside with their gradients, and the copy of each that the worker reduces;
    together never more than the model's gradients twice."""
    if not a.overlap_buckets or not contiguous:  # ZeRO-1/2 overlap only contiguous buckets
        return {}
    held = min(a.overlap_buckets * min(a.reduce_bucket, n), n) * pb * padding
    return {"overlap buckets": 2 * held}


def _mib(size):
    return f"{size / 2**20:.0f} MiB"
