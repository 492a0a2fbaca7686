# SPDX-License-Identifier: Apache-2.0
"""Hierarchical all-reduce of gradients on a cluster of several hosts.

Upstream all-reduces ZeRO-0/1/2 gradient buckets over one flat data-parallel group, so the links
between hosts, often ten times slower than those inside one, carry as much as any in-host link.
Here the sum is taken in three steps (``HierarchicalReducer.all_reduce``):

- **even hosts** (every host has L ranks): reduce-scatter inside each host (local rank j holds
  the host's sum of shard j), all-reduce of shard j across the hosts among the ranks with local
  index j, all-gather inside the host. Each rank sends only its shard between hosts, and the
  L shards of a host travel in parallel.
- **uneven hosts** (e.g. 2 + 1): reduce to each host's leader (its first rank), all-reduce among
  the leaders, broadcast inside the host. The bytes a host sends over its link are the same as
  in the sharded scheme (the whole tensor once, in the leader's all-reduce), only not split over
  several ranks; sharding across hosts whose rank counts differ would need shards of unequal
  sizes, which no collective offers.

In floating point the result equals the flat all-reduce up to the order of the summation. The
optional compression (``compress_inter_host``) rounds only the inter-host step.

Pure parts (``group_layout``, ``shard_size``, ``reduction_decision``) are tested without
processes; the reducer creates its process groups once, on every rank of the world in the same
order (a creation that differs between ranks would hang), and every collective goes through
``deepspeed.comm``, so the fork's comm clock and collective log see each step.

Upstream reaches this module through ``all_reduce(tensor, group)``, called instead of
``deepspeed.comm.all_reduce`` at the gradient all-reduce sites of ZeRO-1/2
(``stage_1_and_2.py``) and ZeRO-0 (``engine.py``); without a reducer for ``group`` it is that
call, after one branch on an empty dict.
"""

from dataclasses import dataclass
from typing import Tuple

import torch

from deepspeed import comm as dist
from deepspeed.utils import logger


COMPRESSION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_reducers = {}
"""Process group -> the HierarchicalReducer that all-reduces over it (set by ``attach``)."""


@dataclass(frozen=True)
class GroupLayout:
    """Which members (indices 0..n-1 of the data-parallel group) share a host and how they pair up."""

    hosts: Tuple[int, ...]
    """Host index of each member, dense 0..H-1 by first appearance."""
    host_members: Tuple[Tuple[int, ...], ...]
    """The members of each host, in member order."""

    @property
    def num_hosts(self):
        return len(self.host_members)

    @property
    def even(self):
        """Every host has the same number of members: the sharded scheme applies."""
        return len({len(members) for members in self.host_members}) == 1

    @property
    def ranks_per_host(self):
        return len(self.host_members[0]) if self.even else None

    @property
    def leaders(self):
        """The first member of each host."""
        return tuple(members[0] for members in self.host_members)

    @property
    def shard_groups(self):
        """Even hosts: for each local index j, the members with local index j on every host (the
        ranks that exchange shard j between hosts)."""
        if not self.even:
            raise ValueError(f"hosts {list(self.hosts)} are uneven: no shard groups")
        return tuple(zip(*self.host_members))

    @property
    def useful(self):
        """More than one host and more than one rank on some host: otherwise the three steps are
        the flat all-reduce with extra work."""
        return self.num_hosts > 1 and len(self.hosts) > self.num_hosts

    def host_of(self, member):
        return self.hosts[member]

    def local_index(self, member):
        return self.host_members[self.hosts[member]].index(member)


def group_layout(hosts):
    """The layout of a data-parallel group whose member i runs on host ``hosts[i]`` (any labels;
    renumbered dense by first appearance)."""
    hosts = tuple(hosts)
    if not hosts:
        raise ValueError("hosts is empty: give the host of each data-parallel rank")
    dense, members = {}, []
    for member, host in enumerate(hosts):
        if host not in dense:
            dense[host] = len(dense)
            members.append([])
        members[dense[host]].append(member)
    return GroupLayout(hosts=tuple(dense[h] for h in hosts), host_members=tuple(map(tuple, members)))


def shard_size(numel, parts):
    """Elements per shard when ``numel`` elements are split into ``parts`` equal shards; the last
    shard is padded with zeros up to ``parts * shard_size(numel, parts)``."""
    return -(-numel // parts)


def reduction_decision(setting, enabled, hosts, zero_stage, dp_is_world):
    """Whether the hierarchical reduction is in force, and a note saying why not (or None).

    Args:
        setting: ``communication.hierarchical_reduction`` (True, False or "auto").
        enabled: ``heterogeneous_config.enabled``.
        hosts: host of each data-parallel rank, or None when unknown (one host).
        zero_stage: the ZeRO stage; stage 3 reduce-scatters through its own path.
        dp_is_world: the data-parallel group is the whole world (no model or sequence parallelism):
            the reducer's groups are created by every rank alike only then.

    Raises ValueError when ``true`` was asked for where the reduction cannot run."""
    if not enabled or setting is False:
        return False, None
    layout = group_layout(hosts) if hosts else None
    if layout is None or layout.num_hosts == 1:
        return False, "the data-parallel ranks run on one host"
    if not layout.useful:
        return False, "every host runs one rank: the flat all-reduce is already hierarchical"
    if zero_stage > 2:
        return False, "ZeRO-3 reduce-scatters gradients through its own path, which stays flat"
    if not dp_is_world:
        if setting is True:
            raise ValueError("heterogeneous_config.communication.hierarchical_reduction is true, but the "
                             "data-parallel group is not the whole world (model or sequence parallelism), which the "
                             "hierarchical reduction does not cover; use \"auto\" or false")
        return False, "the data-parallel group is not the whole world (model or sequence parallelism)"
    return True, None


class HierarchicalReducer:
    """Sum-all-reduce over one data-parallel group, inside hosts first (see the module docstring).

    Construction creates process groups and must run on every rank of the world, in the same
    order relative to every other group creation."""

    def __init__(self, hosts, group=None, compress=False):
        """
        Args:
            hosts: host of each member of ``group`` (member order), e.g. (0, 0, 1, 1).
            group: the data-parallel process group (None: the world).
            compress: False, "bf16" or "fp16": the dtype of the inter-host step.
        """
        self.layout = group_layout(hosts)
        self.group = group
        self.compress = COMPRESSION_DTYPES[compress] if compress else None
        ranks = dist.get_all_ranks_from_group(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) != len(self.layout.hosts):
            raise ValueError(f"hosts {list(hosts)} name {len(self.layout.hosts)} ranks but the data-parallel group "
                             f"has {len(ranks)}")
        self.member = ranks.index(dist.get_rank())
        host = self.layout.host_of(self.member)
        self.host_size = len(self.layout.host_members[host])
        self.leader = ranks[self.layout.leaders[host]]
        self.is_leader = self.leader == dist.get_rank()
        global_members = [[ranks[m] for m in members] for members in self.layout.host_members]
        self.intra_group, _ = torch.distributed.new_subgroups_by_enumeration(global_members)
        if self.layout.even:
            shards = [[ranks[m] for m in column] for column in self.layout.shard_groups]
            self.inter_group, _ = torch.distributed.new_subgroups_by_enumeration(shards)
        else:
            leaders = dist.new_group([ranks[m] for m in self.layout.leaders])
            self.inter_group = leaders if self.is_leader else None

    def all_reduce(self, tensor):
        """Sum ``tensor`` over the group, in place (as ``deepspeed.comm.all_reduce``)."""
        if tensor.numel() == 0:
            return
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        if self.layout.even:
            self._sharded(flat)
        else:
            self._through_leaders(flat)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def _sharded(self, flat):
        shard = shard_size(flat.numel(), self.host_size)
        padded = shard * self.host_size
        buffer = flat
        if padded != flat.numel():
            buffer = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
            buffer[:flat.numel()].copy_(flat)
        part = torch.empty(shard, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_fn(part, buffer, group=self.intra_group)
        self._between_hosts(part)
        dist.allgather_fn(buffer, part, group=self.intra_group)
        if buffer is not flat:
            flat.copy_(buffer[:flat.numel()])

    def _through_leaders(self, flat):
        if self.host_size > 1:
            dist.reduce(flat, self.leader, group=self.intra_group)
        if self.is_leader:
            self._between_hosts(flat)
        if self.host_size > 1:
            dist.broadcast(flat, self.leader, group=self.intra_group)

    def _between_hosts(self, values):
        if self.compress is None or values.dtype == self.compress:
            dist.all_reduce(values, group=self.inter_group)
            return
        sent = values.to(self.compress)
        dist.all_reduce(sent, group=self.inter_group)
        values.copy_(sent)


def all_reduce(tensor, group=None):
    """The gradient all-reduce (sum, in place) at upstream's data-parallel call sites: through the
    reducer ``attach`` built for ``group``, else ``deepspeed.comm.all_reduce`` unchanged."""
    reducer = _reducers.get(group) if _reducers else None
    if reducer is None:
        return dist.all_reduce(tensor, group=group)
    reducer.all_reduce(tensor)


def reducer_for(group):
    """The reducer in force for ``group``, or None."""
    return _reducers.get(group)


def engine_hosts(state, world_size):
    """The host of each data-parallel rank from the fork's discovered topology (``topology.py``:
    the launcher's node rank, which an emulation sets per host), else None (one host)."""
    topology = getattr(state, "topology", None)
    return None if topology is None else tuple(topology.hosts)


def attach(engine):
    """After the engine built its optimizer: route its data-parallel gradient all-reduce through a
    hierarchical reducer when ``communication.hierarchical_reduction`` is in force, otherwise leave
    upstream's flat all-reduce (and drop a reducer an earlier engine left for the same group).

    Every rank decides from the same inputs (the agreed settings, the hosts, the ZeRO stage), so
    every rank creates the same groups or none."""
    state = engine._config.heterogeneous
    group = engine.seq_data_parallel_group
    previous = _reducers.pop(group, None) if _reducers else None
    if not state.enabled:
        return None
    world_size = dist.get_world_size(group=group)
    hosts = engine_hosts(state, world_size)
    communication = state.settings.config.communication
    active, note = reduction_decision(communication.hierarchical_reduction, True, hosts,
                                      engine.zero_optimization_stage(), world_size == dist.get_world_size())
    if not active:
        if note and (communication.hierarchical_reduction is True or communication.compress_inter_host):
            logger.warning(f"heterogeneous_config.communication: hierarchical reduction not in force: {note}")
        return None
    compress = communication.compress_inter_host
    if (previous is not None and previous.layout == group_layout(hosts)
            and previous.compress == (COMPRESSION_DTYPES[compress] if compress else None)):
        reducer = previous  # the same groups again: no second creation
    else:
        reducer = HierarchicalReducer(hosts, group=group, compress=compress)
    _reducers[group] = reducer
    if dist.get_rank() == 0:
        layout = reducer.layout
        scheme = "sharded" if layout.even else "through host leaders"
        # Printed like the plan (runtime.log_plan): a default run shows WARNING and above only.
        print(f"[deepspeed-hetero] hierarchical gradient reduction over {layout.num_hosts} hosts "
              f"{[list(m) for m in layout.host_members]} ({scheme}"
              f"{', inter-host step in ' + compress if compress else ''})", flush=True)
    return reducer
