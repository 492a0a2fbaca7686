# SPDX-License-Identifier: Apache-2.0
"""Low-communication training between hosts (``communication.mode: "low_communication"``): opt-in,
and **not exact**.

Below a few hundred Mbit/s between hosts no exact scheme keeps the communication share of a step
small: every step's gradients must cross the link. In this mode each host trains its own replica of
the model, exact and balanced inside the host (ZeRO-1/2, or ZeRO-0 in fp32, over the host's
ranks; the plan's per-rank micro-batches), and the hosts meet every H = ``sync_every`` optimizer steps, as in DiLoCo
(Douillard et al., 2023):

- every host h forms its pseudo-gradient ``delta_h = theta_outer - theta_h`` over the fp32 master
  weights (``theta_outer``: the model at the last synchronisation);
- the host leaders gather them (in fp32 or bf16: ``pseudo_gradient_dtype``) and each computes, in
  host order and in fp32, ``mean = sum_h w_h * delta_h`` with ``w_h`` the share of the samples host
  h was planned since the last synchronisation;
- the outer Nesterov step: ``m = mu * m + mean``; ``theta_outer -= lr * (mean + mu * m)``
  (``outer_update``); with ``mu = 0`` and ``lr = 1`` that is the samples-weighted average of the
  replicas;
- every rank writes ``theta_outer`` into its replica: the module's parameters and the optimizer's
  fp32 master fragments. The inner optimizer's state (Adam's moments) and the learning-rate
  schedule stay each host's own.

Inside a host the gradient of a step is the mean over the host's samples: the engine's loss weight
(``W * n_i / B``, which makes the world's average the global-batch mean) is scaled by
``P_h * B / (W * B_h)`` (``host_loss_scales``). With inner SGD, H = 1, ``lr = 1`` and ``mu = 0`` the
mode is exact data-parallel training (the average of ``theta - eta * g_h`` weighted by ``B_h / B``
is ``theta - eta * g``); the tests use that as their anchor.

How the engine is made a replica per host: DeepSpeed asks ``deepspeed.utils.groups`` for its
data-parallel group, and ``groups.mpu`` answers where one is set (upstream's hook for a
model-parallel unit). ``HostReplicas`` is such a unit whose data-parallel group is the rank's host
(model-parallel size 1); it is set from ``HeterogeneousState.engine_starting``, before the engine
asks, and cleared by the next engine that is not in this mode. The hosts start from global rank 0's
weights (``LowCommunication.attach``, after the optimizer is built).

Costs: the host leaders keep ``theta_outer`` and the momentum in fp32 on the device (8 bytes per
parameter); at a synchronisation a leader also holds the flat replica, the gathered pseudo-gradients
and their mean for a moment (about 16 + 4 x hosts bytes per parameter in all with fp32
pseudo-gradients, 16 + 2 x hosts in bf16) and every other rank a flat fp32 copy (4); a
synchronisation moves N bytes (fp32; N/2 in bf16) per direction of each host's link when there are
two hosts, against about 3 N per step for an exact ZeRO-2 step (docs/benchmarks.md).

The arithmetic (the loss scales, the weighted mean, the outer step) and the refusal are pure and
live in ``low_communication_plan.py``.
"""

import re
import time

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger

from .host_groups import group_layout
from .low_communication_plan import OuterSettings, host_loss_scales, host_samples, outer_update, refusal, weighted_mean

_ABSENT = object()  # a parameter no optimizer maps to fp32 fragments (its module copy is the master)


# -- the groups DeepSpeed asks for ------------------------------------------------------------


class HostReplicas:
    """A model-parallel unit for ``deepspeed.utils.groups``: the data-parallel group is this rank's
    host, model-parallel size 1. Created on every rank alike (the same group creations in the same
    order)."""

    def __init__(self, hosts):
        self.layout = group_layout(hosts)
        rank = dist.get_rank()
        members = [list(m) for m in self.layout.host_members]
        self.host_group, _ = torch.distributed.new_subgroups_by_enumeration(members)
        self.leader_group = dist.new_group(ranks=list(self.layout.leaders))
        self.single_group, _ = torch.distributed.new_subgroups_by_enumeration([[r] for r in range(len(hosts))])
        self.host = self.layout.hosts[rank]
        self.members = self.layout.host_members[self.host]
        self.leader = self.members[0]

    def get_data_parallel_group(self):
        return self.host_group

    def get_data_parallel_world_size(self):
        return len(self.members)

    def get_data_parallel_rank(self):
        return self.members.index(dist.get_rank())

    def get_data_parallel_group_ranks(self):
        return list(self.members)

    def get_model_parallel_group(self):
        return self.single_group

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


def set_groups(replicas):
    """Make ``replicas`` the groups DeepSpeed's engines ask for (None: clear ours, keep a user's)."""
    from deepspeed.utils import groups
    if replicas is not None:
        groups.mpu = replicas
    elif isinstance(groups.mpu, HostReplicas):
        groups.mpu = None


# -- the synchronisation ----------------------------------------------------------------------


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


class LowCommunication:
    """One engine's replicas and their outer state. ``state.low_communication`` while in force."""

    def __init__(self, replicas, settings):
        self.replicas = replicas
        self.settings = settings
        self.engine = None
        self.params = []
        self.theta = None  # theta_outer, on the host leaders (fp32, flat)
        self.momentum = None
        self.inner_steps = 0  # since the last synchronisation
        self.samples = [0] * replicas.layout.num_hosts  # planned since the last synchronisation
        self.synchronisations = 0
        self.sync_seconds = 0.0  # wall time in synchronisations (this rank), for the profiler and benchmarks
        self._per_plan = None  # (plan samples, per-rank loss scales, samples per host): once per plan

    @property
    def is_leader(self):
        return dist.get_rank() == self.replicas.leader

    def _plan_facts(self, plan):
        """(loss scales per rank, samples per host) of ``plan``, computed once per plan: read at
        every backward and every step."""
        samples = plan.samples_per_rank
        if self._per_plan is None or self._per_plan[0] != samples:
            hosts = self.replicas.layout.hosts
            self._per_plan = (samples, host_loss_scales(samples, hosts), host_samples(samples, hosts))
        return self._per_plan[1:]

    def loss_scale(self, plan, rank):
        """``host_loss_scales`` of ``plan`` for global rank ``rank``."""
        return self._plan_facts(plan)[0][rank]

    def attach(self, engine):
        """After the optimizer is built, on every rank: check that the fp32 master weights can be
        reached, then start every host from global rank 0's weights."""
        self.engine = engine
        self.params = list(engine.module.parameters())
        from ..config.settings import HeterogeneousConfigError
        if dist.get_world_size(group=engine.seq_data_parallel_group) != len(self.replicas.members):
            raise HeterogeneousConfigError(
                "heterogeneous_config.communication.mode \"low_communication\": the engine's data-parallel group "
                f"has {dist.get_world_size(group=engine.seq_data_parallel_group)} ranks, not this host's "
                f"{len(self.replicas.members)} (something set other groups); use mode \"exact\"")
        if engine.fp16_enabled() or engine.bfloat16_enabled():
            unreachable = [p for p in _trainable(engine.module) if not hasattr(p, "_hp_mapping")]
            if unreachable:
                raise HeterogeneousConfigError(
                    "heterogeneous_config.communication.mode \"low_communication\" writes the outer step into the "
                    f"optimizer's fp32 master weights, which {type(engine.optimizer).__name__} does not expose; "
                    "use zero_optimization.stage 1 or 2")
        self._check_coverage()
        theta = self._gather_replica()
        if self.is_leader:
            dist.broadcast(theta, src=0, group=self.replicas.leader_group)
            self.theta = theta
            if self.settings.momentum:
                self.momentum = torch.zeros_like(theta)
        self._write_replica(theta)
        if dist.get_rank() == 0:
            layout = self.replicas.layout
            print(f"[deepspeed-hetero] low-communication training (not exact): {layout.num_hosts} hosts "
                  f"{[list(m) for m in layout.host_members]} each train a replica, synchronised "
                  f"{self.settings.describe()}", flush=True)

    def after_step(self, plan):
        """An optimizer step is done on this rank: count its planned samples per host, and
        synchronise the replicas every ``sync_every`` steps. Returns True when it did."""
        for host, samples in enumerate(self._plan_facts(plan)[1]):
            self.samples[host] += samples
        self.inner_steps += 1
        if self.inner_steps < self.settings.sync_every:
            return False
        self.synchronise()
        return True

    def synchronise(self):
        """The outer step now (a collective on every rank: in-host reduce, leaders' all-gather,
        in-host broadcast)."""
        started = time.perf_counter()
        theta_h = self._gather_replica()
        if self.is_leader:
            delta = theta_h.neg_().add_(self.theta).to(self.settings.dtype)  # in place where fp32
            deltas = [torch.empty_like(delta) for _ in range(self.replicas.layout.num_hosts)]
            dist.all_gather(deltas, delta, group=self.replicas.leader_group)
            del delta
            total = sum(self.samples)
            mean = weighted_mean(deltas, [s / total for s in self.samples])
            del deltas
            outer_update(self.theta, self.momentum, mean, self.settings.lr, self.settings.momentum)
            del mean
            theta_h.copy_(self.theta)
        self._write_replica(theta_h)
        self.inner_steps = 0
        self.samples = [0] * len(self.samples)
        self.synchronisations += 1
        self.sync_seconds += time.perf_counter() - started

    def state_dict(self):
        """What a checkpoint keeps: the counters (every rank) and, on the host leader, whose record
        its host's model-states file holds, ``theta_outer`` and the momentum."""
        return {"hosts": [list(m) for m in self.replicas.layout.host_members], "inner_steps": self.inner_steps,
                "samples": list(self.samples), "synchronisations": self.synchronisations,
                "theta": self.theta if self.is_leader else None,
                "momentum": self.momentum if self.is_leader else None}

    def load_state_dict(self, saved):
        hosts = [list(m) for m in self.replicas.layout.host_members]
        if saved["hosts"] != hosts:
            from ..config.settings import HeterogeneousConfigError
            raise HeterogeneousConfigError(f"this low-communication checkpoint was saved on hosts {saved['hosts']}, "
                                           f"and this run has {hosts}: resume on the same hosts")
        self.inner_steps, self.samples = saved["inner_steps"], list(saved["samples"])
        self.synchronisations = saved["synchronisations"]
        if self.is_leader:
            self.theta.copy_(saved["theta"])
            if self.momentum is not None:
                self.momentum.copy_(saved["momentum"])

    def _check_coverage(self):
        """The host's ranks' fp32 fragments cover every element of the model exactly once (a stale
        mapping of an earlier engine on the same module would leave holes)."""
        covered = 0
        for param in self.params:
            mapping = getattr(param, "_hp_mapping", _ABSENT)
            if mapping is _ABSENT:
                covered += param.numel() if dist.get_rank() == self.replicas.leader else 0
            elif mapping is not None:
                covered += mapping.lp_fragment_address.numel
        total = torch.tensor([covered], dtype=torch.int64, device=self.params[0].device)
        if len(self.replicas.members) > 1:
            dist.all_reduce(total, group=self.replicas.host_group)
        expected = sum(p.numel() for p in self.params)
        if int(total.item()) != expected:
            raise RuntimeError(f"deepspeed-hetero: low-communication: the optimizer's fp32 fragments on this host "
                               f"cover {int(total.item())} of the model's {expected} elements")

    def _gather_replica(self):
        """The host's fp32 master weights, flat in ``module.parameters()`` order, on the host leader
        (a transient buffer on the other ranks): each rank adds the fragments its optimizer holds,
        the leader a parameter no optimizer fragment covers (the module's own copy)."""
        rank = dist.get_rank()
        numel = sum(p.numel() for p in self.params)
        device = self.params[0].device
        flat = torch.zeros(numel, dtype=torch.float32, device=device)
        offset = 0
        for param in self.params:
            mapping = getattr(param, "_hp_mapping", _ABSENT)
            if mapping is _ABSENT:
                if rank == self.replicas.leader:
                    flat.narrow(0, offset, param.numel()).copy_(param.detach().reshape(-1))
            elif mapping is not None:
                address = mapping.lp_fragment_address
                flat.narrow(0, offset + address.start, address.numel).copy_(mapping.get_hp_fragment().reshape(-1))
            offset += param.numel()
        if len(self.replicas.members) > 1:
            dist.reduce(flat, dst=self.replicas.leader, group=self.replicas.host_group)
        return flat

    def _write_replica(self, flat):
        """Broadcast ``flat`` (on the leader) inside the host and write it into this rank's module
        parameters and optimizer fp32 fragments."""
        if len(self.replicas.members) > 1:
            dist.broadcast(flat, src=self.replicas.leader, group=self.replicas.host_group)
        offset = 0
        with torch.no_grad():
            for param in self.params:
                values = flat.narrow(0, offset, param.numel())
                param.data.copy_(values.view_as(param.data))
                mapping = getattr(param, "_hp_mapping", None)
                if mapping is not None:
                    address = mapping.lp_fragment_address
                    mapping.get_hp_fragment().data.copy_(
                        values.narrow(0, address.start, address.numel).view_as(mapping.get_hp_fragment()))
                offset += param.numel()


def host_tag(tag, host):
    """The tag host ``host`` writes or reads its replica under: ``<tag>/host<h>`` (a tag that already
    names a host, as ``latest`` does, is re-pointed)."""
    return f"{re.sub(r'/host[0-9]+$', '', str(tag))}/host{host}"


def replica_folder(low, load_dir, tag, load_module_only=False):
    """``load_checkpoint``'s tag in this mode: the host's own replica, ``<tag>/host<h>``. Every rank
    checks its host's folder and the verdicts are gathered, so that a checkpoint of another mode or
    of fewer hosts stops every rank with one message (a collective on the world)."""
    import os
    import torch
    from ..config.errors import one_line_config_errors
    from ..config.settings import HeterogeneousConfigError
    mine = host_tag(tag, low.replicas.host)
    from deepspeed.accelerator import get_accelerator
    found = torch.tensor([int(os.path.isdir(os.path.join(load_dir, mine)))], dtype=torch.int32,
                         device=get_accelerator().current_device_name())
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    if not int(found.item()):
        one_line_config_errors()
        raise HeterogeneousConfigError(
            f"load_checkpoint with heterogeneous_config.communication.mode \"low_communication\" reads each host's "
            f"replica from <tag>/host<h>, and {os.path.join(load_dir, mine)} (or another host's) does not exist: "
            f"load a checkpoint this mode saved on the same hosts"
            f"{' (module weights: load them into the model before deepspeed.initialize)' if load_module_only else ''}")
    return mine


def load_low_communication(low, saved):
    """Restore the outer state a checkpoint of this mode saved (``LowCommunication.state_dict``), on
    a run in the same mode on the same hosts."""
    from ..config.settings import HeterogeneousConfigError
    if low is None:
        raise HeterogeneousConfigError("this checkpoint was saved with heterogeneous_config.communication.mode "
                                       "\"low_communication\" (one replica per host); load it in that mode")
    if saved is None:
        raise HeterogeneousConfigError("this checkpoint holds no low-communication state: it was saved in mode "
                                       "\"exact\"; load it in that mode")
    low.load_state_dict(saved)


def start(state, ds_config, engine, model, pipeline):
    """From ``HeterogeneousState.engine_starting`` (every rank alike, after the config is
    coordinated, before the engine asks for its groups): in ``mode: "low_communication"``, refuse
    what it cannot cover, create the host groups and set them for the engine; else clear a unit an
    earlier engine set. Returns the ``LowCommunication`` or None."""
    communication = state.settings.config.communication if state.enabled else None
    if communication is None or communication.mode != "low_communication":
        set_groups(None)
        return None
    from deepspeed.moe.layer import MoE
    from deepspeed.runtime.model_checkpointing.constants import CHECKPOINT_WRITER
    from deepspeed.utils import groups
    topology = getattr(state, "topology", None)
    hosts = None if topology is None else tuple(topology.hosts)
    autotp = getattr(getattr(ds_config, "tensor_parallel_config", None), "autotp_size", 0) or 0
    model_parallel = (getattr(engine, "mpu", None) is not None or groups.mesh_device is not None or autotp > 1
                      or getattr(ds_config, "sequence_parallel_size", 1) not in (None, 1)
                      or (groups.mpu is not None and not isinstance(groups.mpu, HostReplicas)))
    writer = (getattr(ds_config, "checkpoint_config", None) or {}).get(CHECKPOINT_WRITER) is not None
    reason = refusal(state.settings, ds_config.zero_optimization_stage, pipeline, model_parallel,
                     model is not None and any(isinstance(m, MoE) for m in model.modules()), hosts,
                     low_precision=bool(ds_config.float16_config.enabled or ds_config.bfloat16_config.enabled),
                     checkpoint_writer=writer)
    if reason is not None:
        from ..config.errors import one_line_config_errors
        from ..config.settings import HeterogeneousConfigError
        one_line_config_errors()
        raise HeterogeneousConfigError(reason)
    if state.settings.config.resplit_fed_batches == "auto":
        state.settings.config.resplit_fed_batches = False  # agreed on every rank: rows stay on their host
    replicas = HostReplicas(hosts)
    set_groups(replicas)
    if state.dp_rank == 0:
        logger.warning("deepspeed-hetero: communication.mode \"low_communication\": each host trains its own replica "
                       "and the hosts meet every %d steps; the result is not single-process training's",
                       communication.low_communication.sync_every)
    return LowCommunication(replicas, OuterSettings.from_config(communication.low_communication))
