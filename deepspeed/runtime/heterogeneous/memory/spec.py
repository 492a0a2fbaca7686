# SPDX-License-Identifier: Apache-2.0
"""``ModelStateSpec``: the fork's one memory model of a rank, as every part asks it (the memory
pool's placement, the start-up plan's memory cap, the runtime's emulated memory and profiling
limits, the heterogeneous profiler, the env report, the autotuner's cost model).

It has two levels of detail. ``state_bytes`` is the model state a rank keeps
(``model_state.model_state_bytes``: parameters, gradients, optimizer state and master copy of its
ZeRO share). ``peak`` is the peak it reaches phase by phase (``peak.predict_peak``: those states and
the buffers and temporaries DeepSpeed allocates around them, plus activations and what was in use
at the start). ``device_bytes`` answers at the finest level the facts allow: the peak without
activations where DeepSpeed's allocations are known (``allocations``: always for an engine, from
its config and model), the model state where they are not (a config without a model, the
autotuner's profile of another run). Which level a caller gets depends on what is known, never on a
setting.

The spec holds the trainable parameters, the ZeRO stage, the bytes per parameter of weights,
gradients, optimizer state and master copy, whether upstream's ``offload_optimizer`` already moves
every rank's optimizer off the device, and ZeRO-3's optimizer sub-groups, which a rank offloads
whole (``zero3_offload_fraction``, ``zero3_offload_ratio``)."""

import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .model_state import (model_state_inputs, model_state_bytes, model_state_parts, model_sub_groups,
                          offloaded_fraction)
from .peak import ZeroAllocations, predict_peak


@dataclass(frozen=True)
class ModelStateSpec:
    """What the pool places: the model's trainable parameters and how ZeRO keeps their state."""

    num_parameters: int
    zero_stage: int
    param_bytes: int = 4
    """Bytes per parameter and gradient in the training dtype (2 under fp16/bf16)."""
    optimizer_bytes: int = 8
    """Optimizer state per parameter (Adam: 8; ``model_state.optimizer_state_bytes``)."""
    master_bytes: int = 0
    """The fp32 master copy under fp16/bf16 (4); ZeRO 1-3 count 4 whatever it says."""
    optimizer_device: Optional[str] = None
    """Upstream's ``offload_optimizer.device`` ("cpu"/"nvme"), which offloads every rank."""
    sub_groups: Optional[Tuple[float, ...]] = None
    """ZeRO-3: each optimizer sub-group's fraction of a rank's partitioned state, in upstream's
    order (``zero3_sub_groups``); a rank offloads whole sub-groups, the last ones first. None:
    unknown (a config without a model), the ratio is then counted in hundredths."""
    partial_offload: bool = True
    """ZeRO-3: whether a rank may offload part of its sub-groups (upstream's ``offload_optimizer.ratio``
    below 1 steps the offloaded ones with ``DeepSpeedCPUAdam``, which only an Adam-type optimizer
    gets); False: a rank that must offload offloads all of its optimizer state."""
    allocations: Optional[ZeroAllocations] = None
    """What sizes DeepSpeed's buffers (``peak.py``); None: the model state alone is counted."""
    host_shards: bool = False
    """ZeRO-3 on several hosts: each host also keeps a copy of the parameters, cut among its ranks in
    proportion to their shares (``communication.zero3_host_shards``, ``comm/host_shards.py``)."""

    def __post_init__(self):
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage {self.zero_stage!r} must be 0, 1, 2 or 3")
        if self.num_parameters < 0:
            raise ValueError(f"num_parameters {self.num_parameters!r} must be >= 0")
        if self.sub_groups is not None and (not self.sub_groups or abs(sum(self.sub_groups) - 1.0) > 1e-6):
            raise ValueError(f"sub_groups {self.sub_groups!r} must be fractions of the partition that sum to 1")

    def _inputs(self):
        return dict(param_bytes=self.param_bytes, optimizer_bytes=self.optimizer_bytes,
                    master_bytes=self.master_bytes)

    def parts(self, world, share):
        return model_state_parts(self.num_parameters, self.zero_stage, world, share=share, **self._inputs())

    def state_bytes(self, world, share=None, offloaded=0.0):
        """The model state a rank keeps on the device (the first level of detail); ``offloaded``:
        the part of its optimizer state off the device (all of it under upstream's
        ``offload_optimizer``)."""
        return model_state_bytes(self.num_parameters, self.zero_stage, world, share=share,
                                 optimizer_offloaded=offloaded or self.optimizer_device is not None, **self._inputs())

    def device_bytes(self, world, share, offloaded=False, largest_share=None, host_shard=0.0, hosts=1):
        """Bytes on the device: the predicted peak (``peak.py``) when the allocations are known,
        without baseline and activations, which differ per rank; else the model state (and the
        host shard, a fraction of the model's parameters)."""
        if self.allocations is not None:
            return self.peak(share, offloaded, largest_share=largest_share, host_shard=host_shard,
                             hosts=hosts).peak_bytes
        return model_state_bytes(self.num_parameters, self.zero_stage, world, share=share,
                                 optimizer_offloaded=offloaded or self.optimizer_device is not None, **self._inputs()
                                 ) + self.host_shard_bytes(host_shard)

    def host_shard_bytes(self, host_shard):
        """The bytes of a host shard holding ``host_shard`` of the model (0 without host shards)."""
        return self.num_parameters * self.param_bytes * float(host_shard) if self.zero_stage == 3 else 0.0

    def peak(self, share, offloaded=0.0, activation_bytes=0.0, baseline_bytes=0.0, largest_share=None,
             host_shard=0.0, hosts=1):
        """``peak.predict_peak`` of a rank (``allocations`` must be known)."""
        offloaded = 1.0 if self.optimizer_device is not None else float(offloaded)
        return predict_peak(self.allocations, share=share if self.zero_stage >= 1 else None, offloaded=offloaded,
                            activation_bytes=activation_bytes or 0.0, baseline_bytes=baseline_bytes or 0.0,
                            largest_share=largest_share if self.zero_stage >= 1 else None,
                            host_shard=host_shard if self.zero_stage == 3 else 0.0, hosts=hosts)

    @classmethod
    def for_engine(cls, ds_config, model, optimizer=None, emulated_device=False):
        """The state of ``model`` under a ``DeepSpeedConfig``, counted as the planner counts it
        (``model_state.config_model_state_bytes``): the client's optimizer instance, else the
        config's. ``emulated_device``: the rank's capacity is emulated by accounting, a device apart
        from the host even on the CPU accelerator."""
        import torch
        client = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        if client is None:
            optimizer = getattr(ds_config, "optimizer_name", None) or "unknown"
        offload = ds_config.zero_config.offload_optimizer
        half = ds_config.float16_config.enabled or ds_config.bfloat16_config.enabled
        stage = int(ds_config.zero_optimization_stage or 0)
        spec = cls._from_inputs(model_state_inputs(model.parameters(), half, optimizer, False), stage,
                                _offload_device(offload))
        spec = replace(spec, allocations=engine_allocations(ds_config, model, client or optimizer, spec, emulated_device))
        if stage != 3:
            return spec
        return replace(spec, sub_groups=model_sub_groups(ds_config, model, client),
                       partial_offload=cpu_adam_optimizer(ds_config, client))

    @classmethod
    def of_engine(cls, engine, emulated_device=False):
        """``for_engine`` of a running engine: its config, module and built optimizer."""
        optimizer = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
        return cls.for_engine(engine._config, engine.module, optimizer, emulated_device)

    def rank_bytes(self, ds_config, share=None, largest_share=None, sub_groups=None):
        """``device_bytes`` of a rank under ``ds_config`` (a ``DeepSpeedConfig``): its share of the
        partitioned state and the part of its optimizer state ``offload_optimizer`` moves off the
        device (``sub_groups``: a built ZeRO-3 optimizer's, else the spec's)."""
        offloaded = offloaded_fraction(ds_config.zero_config, sub_groups or self.sub_groups)
        return self.device_bytes(int(ds_config.world_size), share, offloaded, largest_share=largest_share)

    @classmethod
    def for_config_dict(cls, param_dict, num_parameters, half, world=None, emulated_device=True):
        """The state of a model of ``num_parameters`` under a ds_config dict (no engine, no model),
        with DeepSpeed's buffers (``peak.py``) on ``world`` data-parallel ranks when known; the
        tensors' sizes are not known, so no gradient of a largest parameter is counted in flight,
        and nothing is in use at the start. ``emulated_device``: a device apart from the host."""
        from types import SimpleNamespace
        from deepspeed.runtime.config import get_optimizer_name, get_optimizer_params
        from deepspeed.runtime.zero.config import get_zero_config
        zero = get_zero_config(param_dict)
        name = get_optimizer_name(param_dict)
        optimizer = SimpleNamespace(optimizer_name=name, optimizer_params=get_optimizer_params(param_dict))
        spec = cls(num_parameters=int(num_parameters), zero_stage=int(zero.stage), param_bytes=2 if half else 4,
                   optimizer_bytes=_optimizer_bytes(name or "unknown"), master_bytes=4 if half else 0,
                   optimizer_device=_offload_device(zero.offload_optimizer),
                   partial_offload=cpu_adam_optimizer(optimizer))
        if world is None:
            return spec
        allocations = ZeroAllocations(
            num_parameters=int(num_parameters), largest_parameter=0, zero_stage=spec.zero_stage, world=int(world),
            param_bytes=spec.param_bytes, optimizer_bytes=spec.optimizer_bytes,
            optimizer_temporaries=optimizer_temporaries(optimizer, None), master_bytes=spec.master_bytes,
            foreach=emulated_device, host_is_device=not emulated_device, **zero_buffer_settings(zero),
            gradient_accumulation_steps=int(param_dict.get("gradient_accumulation_steps") or 1))
        return replace(spec, allocations=allocations)

    @classmethod
    def _from_inputs(cls, inputs, zero_stage, optimizer_device):
        return cls(num_parameters=int(inputs["num_parameters"]), zero_stage=zero_stage,
                   param_bytes=inputs["param_bytes"], optimizer_bytes=inputs["optimizer_bytes"],
                   master_bytes=inputs["master_bytes"], optimizer_device=optimizer_device)


def engine_allocations(ds_config, model, optimizer, spec, emulated_device=False):
    """``ZeroAllocations`` of ``model`` under a ``DeepSpeedConfig`` on this rank's accelerator: the
    bucket sizes and ZeRO-3 limits as upstream resolves them, the optimizer's temporaries (torch's
    Adam family allocates them; DeepSpeed's fused and CPU Adam update in place), where the
    parameters are and whether the device is host memory."""
    import torch
    from deepspeed.accelerator import get_accelerator
    zero = ds_config.zero_config
    params = [p for p in model.parameters() if p.requires_grad]
    numels = [int(getattr(p, "ds_numel", p.numel())) for p in params]
    frozen = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if not p.requires_grad)
    device = get_accelerator().device_name()
    on_host = device == "cpu" and not emulated_device
    resident = device == "cpu" or all(p.device.type == device for p in params)
    return ZeroAllocations(num_parameters=sum(numels), largest_parameter=max(numels, default=0),
                           zero_stage=spec.zero_stage, world=int(ds_config.world_size), param_bytes=spec.param_bytes,
                           optimizer_bytes=spec.optimizer_bytes,
                           optimizer_temporaries=optimizer_temporaries(ds_config, optimizer),
                           master_bytes=spec.master_bytes, foreach=not on_host, **zero_buffer_settings(zero),
                           host_is_device=on_host, parameters_resident=resident,
                           converted=spec.param_bytes < 4 and any(p.dtype == torch.float32 for p in params),
                           frozen_parameters=frozen,
                           gradient_accumulation_steps=int(getattr(ds_config, "gradient_accumulation_steps", 1) or 1))


def zero_buffer_settings(zero):
    """The ``zero_optimization`` settings that size DeepSpeed's buffers, as ``ZeroAllocations``
    fields (``zero``: upstream's validated ``DeepSpeedZeroConfig``, defaults resolved)."""
    return dict(reduce_bucket=int(zero.reduce_bucket_size), allgather_bucket=int(zero.allgather_bucket_size),
                overlap_comm=bool(zero.overlap_comm), contiguous_gradients=bool(zero.contiguous_gradients),
                max_live_parameters=int(zero.max_live_parameters), prefetch_bucket=int(zero.prefetch_bucket_size),
                max_reuse_distance=int(zero.max_reuse_distance),
                sub_group_size=int(zero.sub_group_size))


def optimizer_temporaries(ds_config, optimizer):
    """Tensors of the stepped tensor's size an optimizer's step allocates: torch's Adam/AdamW 2
    (``exp_avg_sq.sqrt()`` and its division); a config Adam is DeepSpeed's fused or CPU Adam (in
    place) unless ``torch_adam``; SGD and others 0."""
    import torch
    if isinstance(optimizer, torch.optim.Optimizer):
        return 2 if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) else 0
    name = str(getattr(ds_config, "optimizer_name", None) or "").lower()
    params = getattr(ds_config, "optimizer_params", None) or {}
    if name in ("adam", "adamw"):
        return 2 if params.get("torch_adam", False) else 0
    return 0


def cpu_adam_optimizer(ds_config, optimizer=None):
    """Whether an offloading rank's optimizer will be ``DeepSpeedCPUAdam``, which upstream's ZeRO-3
    partial offload (``offload_optimizer.ratio`` < 1) requires: a client's instance of it, or an
    Adam/AdamW from the config (``optimizer_name``, ``optimizer_params``) without ``torch_adam``."""
    if optimizer is not None:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return isinstance(optimizer, DeepSpeedCPUAdam)
    name = str(getattr(ds_config, "optimizer_name", None) or "").lower()
    params = getattr(ds_config, "optimizer_params", None) or {}
    return name in ("adam", "adamw") and not params.get("torch_adam", False)


def zero3_offload_fraction(rank, model_state):
    """The smallest part of a ZeRO-3 rank's optimizer state to offload so that the rank (a
    ``RankPlacement``) fits: whole sub-groups,
    the last ones first, as upstream's ``offload_optimizer.ratio`` moves them (``sub_groups``
    known), else hundredths; all of it where partial offload is not possible."""
    needed = rank.device_bytes - rank.budget_bytes
    if rank.optimizer_bytes <= 0 or not model_state.partial_offload:
        return 1.0
    wanted = needed / rank.optimizer_bytes
    if model_state.sub_groups is None:
        return min(1.0, math.ceil(wanted * 100) / 100)
    return _last_sub_groups(model_state.sub_groups, wanted)[1]


def offloaded_sub_groups(sub_groups, fraction):
    """How many of the last ``sub_groups`` make up ``fraction`` (None: sub-groups unknown)."""
    if sub_groups is None:
        return None
    return 0 if fraction <= 0 else _last_sub_groups(sub_groups, fraction)[0]


def _last_sub_groups(sub_groups, part):
    """``(count, fraction)``: the fewest of the last ``sub_groups`` whose fractions reach ``part``."""
    held = 0.0
    for count, fraction in enumerate(reversed(sub_groups), start=1):
        held += fraction
        if held >= part - 1e-9:
            return count, min(1.0, held)
    return len(sub_groups), 1.0


def zero3_offload_ratio(sub_groups_offloaded, sub_groups):
    """The ``offload_optimizer.ratio`` that makes upstream offload exactly the last
    ``sub_groups_offloaded`` of ``sub_groups`` sub-groups. Upstream keeps the first
    ``int((1 - ratio) * n)`` on the device; a ratio half a sub-group short of k/n keeps that product
    clear of the integer below it whatever the floating-point rounding. 1.0: all of them."""
    if sub_groups_offloaded >= sub_groups:
        return 1.0
    return (sub_groups_offloaded - 0.5) / sub_groups


def _optimizer_bytes(name):
    from .model_state import optimizer_state_bytes
    return optimizer_state_bytes(str(name))


def _offload_device(offload):
    device = None if offload is None else str(getattr(offload.device, "value", offload.device))
    return device if device in ("cpu", "nvme") else None
