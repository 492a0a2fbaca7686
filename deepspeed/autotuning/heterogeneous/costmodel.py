# SPDX-License-Identifier: Apache-2.0
"""Predict an experiment's step time and per-rank memory from one profiling run (pure).

The profiling run is a compute_aware experiment: its profiling steps fit every rank's
``a + b * mbs`` seconds per micro-step (optimizer step included) and its activation bytes
``base + per_sample * mbs`` (deepspeed/runtime/heterogeneous). Ranks of one device class get
one measurement each in the same run, so each class is profiled once. A candidate (stage, gas,
per-rank sizes) is predicted as::

    step time  = max_i gas * (a_i + b_i * mbs_i) + communication(s, gas)
    memory_i   = bytes besides activations of stage s on rank i + base_i + per_sample_i * mbs_i
    fits       = memory_i <= hbm_utilization_threshold * capacity_i on every rank

The bytes besides activations are the fork's one memory model's (``memory/spec.ModelStateSpec``),
as the pool and the planner count them: DeepSpeed's predicted peak for stage s where the profile
carries the engine's allocations (buffer sizes, largest parameter, optimizer temporaries), else the
model state alone.

The time models are each rank's own time, collectives left out (``measure/timing.py``). ZeRO stages
differ in what they communicate: ``communication(s, gas)`` is the bytes stage ``s`` sends per step
(``deepspeed plan``'s model, ``forecast/comm_model.py``) at the bandwidth the profiling run measured:
the bytes its own stage sent per step over the seconds its ranks spent in collectives (the rank that
waited least, whose time is the transfers'). Without that measurement (a profile from an older run)
the prediction is compute alone. Either way real experiments rank the stages: bytes are not all a
stage costs (ZeRO-3's per-module gathers and hooks cost more than its bytes on CPU ranks), so only
what the plan can rule out is pruned (``search.TuningSearch._pruned``).
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

from deepspeed.runtime.heterogeneous.forecast.comm_model import bytes_over_link, zero_collectives
from deepspeed.runtime.heterogeneous.memory.peak import ZeroAllocations
from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec
from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
from deepspeed.runtime.heterogeneous.planning.strategies import COMPUTE_AWARE

@dataclass(frozen=True)
class _Link:
    bytes_per_s: float
    latency_us: float


_UNIT_LINK = _Link(1.0, 0.0)
"""A link of one byte per second and no latency: ``zero_collectives``' seconds are then its bytes."""

SPEED_SPREAD_HETEROGENEOUS = 0.25
"""Ranks whose per-sample times differ by more than this are treated as different devices."""


@dataclass(frozen=True)
class Prediction:
    step_seconds: float
    throughput: float
    memory_bytes: Tuple[float, ...]
    fits: bool
    communication_seconds: float = 0.0
    """Part of ``step_seconds``: the stage's collectives at the measured bandwidth (0: not measured)."""

    def metric(self, name):
        if name == "latency":
            return self.step_seconds
        return self.throughput  # flops per second is proportional to samples per second


@dataclass
class ClusterProfile:
    time_models: List[TimeModel]
    activation_base: List[float]
    activation_per_sample: List[float]
    capacities: List[Optional[float]]
    utilization: float
    num_parameters: int
    param_bytes: int
    optimizer_bytes: int
    master_bytes: int
    optimizer_offloaded: bool
    devices: List[str]
    allocations: Optional[ZeroAllocations] = None
    """The profiled engine's allocations (``peak.ZeroAllocations``), its stage replaced per
    candidate; None: the model state alone is counted."""
    collective_seconds: Optional[float] = None
    """Seconds per step in collectives during the profiling steps, the rank that waited least; None:
    not measured."""
    profile_stage: Optional[int] = None
    profile_gas: int = 1
    backend: Optional[str] = None
    """The profiled process group's backend: on "gloo" a reduce-scatter costs an all-reduce."""

    @classmethod
    def from_metrics(cls, metrics):
        """From an experiment's metrics JSON (its ``profile`` and ``ranks`` entries)."""
        profile = metrics.get("profile")
        if not profile:
            raise ValueError("the profiling experiment wrote no per-rank profile (heterogeneous_config compute_aware "
                             "with profile_steps > 0 must run before end_profile_step)")
        ranks = profile["ranks"]
        capacities = []
        for entry, measured in zip(ranks, metrics["ranks"]):
            # The rank's device (or emulated) capacity; else its share of the host (CPU).
            capacities.append(entry["capacity_bytes"] if entry["capacity_bytes"] is not None else
                              measured.get("memory_capacity_bytes"))
        first = ranks[0]
        # The runtime already replaced implausible fits (planner.plausible_time_model) before it
        # added the optimizer step, a real fixed cost, to a.
        models = [TimeModel(r["a"], r["b"]) for r in ranks]
        collectives = [r.get("collective_seconds") for r in ranks]
        return cls(time_models=models,
                   activation_base=[r["activation_base"] for r in ranks],
                   activation_per_sample=[r["activation_per_sample"] for r in ranks],
                   capacities=capacities, utilization=first["utilization"],
                   num_parameters=first["num_parameters"], param_bytes=first["param_bytes"],
                   optimizer_bytes=first["optimizer_bytes"], master_bytes=first["master_bytes"],
                   optimizer_offloaded=first["optimizer_offloaded"], devices=list(profile["devices"]),
                   allocations=ZeroAllocations(**first["allocations"]) if first.get("allocations") else None,
                   collective_seconds=None if None in collectives else min(collectives),
                   profile_stage=profile.get("zero_stage"), profile_gas=int(first.get("profile_gas") or 1),
                   backend=first.get("backend"))

    @property
    def world_size(self):
        return len(self.time_models)

    @property
    def heterogeneous(self):
        """Different per-sample speeds, memories or device names."""
        speeds = [m.b for m in self.time_models]
        spread = max(speeds) / min(speeds) - 1.0
        known = {c for c in self.capacities if c is not None}
        return (spread > SPEED_SPREAD_HETEROGENEOUS or len(set(self.devices)) > 1 or
                (len(known) > 1 and max(known) > 1.1 * min(known)))

    def state_bytes(self, stage):
        """A rank's bytes besides activations at ZeRO ``stage`` (even shares)."""
        allocations = None if self.allocations is None else replace(self.allocations, zero_stage=int(stage),
                                                                    world=self.world_size)
        spec = ModelStateSpec(num_parameters=self.num_parameters, zero_stage=int(stage), param_bytes=self.param_bytes,
                              optimizer_bytes=self.optimizer_bytes, master_bytes=self.master_bytes,
                              allocations=allocations)
        return spec.device_bytes(self.world_size, None, offloaded=float(self.optimizer_offloaded))

    def max_micro_batch(self, stage):
        """Per rank, the largest micro-batch predicted to fit (None: no limit known)."""
        caps = []
        for rank, capacity in enumerate(self.capacities):
            if capacity is None:
                caps.append(None)
                continue
            room = capacity * self.utilization - self.state_bytes(stage) - self.activation_base[rank]
            per_sample = max(self.activation_per_sample[rank], 1.0)
            caps.append(max(0, int(room // per_sample)))
        return caps

    def stage_bytes(self, stage, gas):
        """Bytes each rank sends per optimizer step at ZeRO ``stage`` with ``gas`` micro-steps (even shares)."""
        world = self.world_size
        backend = "gloo" if self.backend == "gloo" else "nccl"
        return bytes_over_link(zero_collectives(int(stage), self.num_parameters, self.param_bytes, world, gas,
                                                1.0 / world, _UNIT_LINK, backend=backend))

    @property
    def bytes_per_second(self):
        """The bandwidth the profiling run's collectives achieved (bytes sent per rank per second); None:
        not measured, or nothing sent."""
        if self.collective_seconds is None or self.profile_stage is None or not self.collective_seconds > 0:
            return None
        sent = self.stage_bytes(self.profile_stage, self.profile_gas)
        return sent / self.collective_seconds if sent > 0 else None

    def communication(self, stage, gas):
        """Predicted seconds per step in stage ``stage``'s collectives; 0 where not measured."""
        bandwidth = self.bytes_per_second
        return 0.0 if bandwidth is None else self.stage_bytes(stage, gas) / bandwidth

    def predict(self, stage, gas, sizes):
        if len(sizes) != self.world_size:
            raise ValueError(f"{len(sizes)} micro-batch sizes for {self.world_size} ranks")
        communication = self.communication(stage, gas)
        step = max(gas * model.micro_step_time(m) for model, m in zip(self.time_models, sizes)) + communication
        state = self.state_bytes(stage)
        memory = tuple(state + base + per * m
                       for base, per, m in zip(self.activation_base, self.activation_per_sample, sizes))
        fits = all(c is None or used <= self.utilization * c for used, c in zip(memory, self.capacities))
        return Prediction(step_seconds=step, throughput=sum(sizes) * gas / step, memory_bytes=memory, fits=fits,
                          communication_seconds=communication)

    def balanced_sizes(self, stage, gas, per_micro_step):
        """The planner's compute-aware split of ``per_micro_step`` samples, within memory; None
        when no split fits."""
        caps = self.max_micro_batch(stage)
        if any(c is not None and c < 1 for c in caps):
            return None
        known = [c for c in caps if c is not None]
        if len(known) == len(caps) and sum(known) < per_micro_step:
            return None
        try:
            plan = plan_micro_batches(self.time_models, train_batch_size=per_micro_step * gas,
                                      gradient_accumulation_steps=gas, strategy=COMPUTE_AWARE,
                                      max_micro_batch=None if not known else caps)
        except ValueError:
            return None
        return tuple(plan.micro_batch_sizes)

    def summary(self):
        rows = []
        for rank, (model, device) in enumerate(zip(self.time_models, self.devices)):
            cap = self.capacities[rank]
            rows.append(f"rank {rank} ({device}): {model.a * 1e3:.1f} ms + {model.b * 1e3:.2f} ms/sample, "
                        f"activations {self.activation_per_sample[rank] / 2**20:.2f} MiB/sample, capacity "
                        f"{'unknown' if cap is None else f'{cap / 2**30:.3g} GiB'}")
        bandwidth = self.bytes_per_second
        if bandwidth is not None:
            rows.append(f"collectives: {self.collective_seconds * 1e3:.1f} ms per step at ZeRO-{self.profile_stage}, "
                        f"{bandwidth / 2**20:.1f} MiB/s per rank: each stage's communication is predicted from it")
        return rows
