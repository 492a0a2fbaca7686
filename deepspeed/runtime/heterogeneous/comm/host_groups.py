# SPDX-License-Identifier: Apache-2.0
"""The pure parts of the hierarchical reduction (``hierarchical.py``): which data-parallel ranks
share a host, which slices of a flat bucket each host's ranks read, how a tensor is packed for the
inter-host step and cut into pieces, and whether the reduction is in force. No processes: tested
in ``test_hierarchical.py`` without ranks.
"""

from dataclasses import dataclass
from typing import Tuple

import torch


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


def owner_members(owners):
    """The members that read a slice after the reduction: ZeRO passes a partition id (int) or a
    frozenset of them (a matrix several ranks update whole)."""
    return (owners, ) if isinstance(owners, int) else tuple(sorted(owners))


def host_ranges(layout, segments):
    """For each host, the ``(start, numel)`` ranges of a flat tensor that some member of that host
    reads after a reduction to owners (adjacent ranges merged).

    Args:
        layout: the group's ``GroupLayout``.
        segments: ``(numel, owners)`` for consecutive slices of the flat tensor, in order; owners as
            ``owner_members`` takes them."""
    ranges = [[] for _ in range(layout.num_hosts)]
    start = 0
    for numel, owners in segments:
        if numel < 0:
            raise ValueError(f"a segment of {numel} elements")
        if numel:
            for host in sorted({layout.host_of(member) for member in owner_members(owners)}):
                mine = ranges[host]
                if mine and mine[-1][0] + mine[-1][1] == start:
                    mine[-1] = (mine[-1][0], mine[-1][1] + numel)
                else:
                    mine.append((start, numel))
        start += numel
    return tuple(tuple(r) for r in ranges)


def ranges_numel(ranges):
    return sum(numel for _, numel in ranges)


def pack(flat, ranges):
    """The elements of ``ranges`` (``host_ranges``) of ``flat``, concatenated (a new tensor)."""
    if not ranges:
        return flat.new_empty(0)
    return torch.cat([flat.narrow(0, start, numel) for start, numel in ranges])


def unpack(packed, flat, ranges):
    """Write ``packed`` (as ``pack`` made it) back into ``ranges`` of ``flat``."""
    offset = 0
    for start, numel in ranges:
        flat.narrow(0, start, numel).copy_(packed.narrow(0, offset, numel))
        offset += numel


PIECE_SECONDS = 0.004
"""An inter-host piece takes about this long on the slowest measured link (see
``HierarchicalReducer.leaders_all_to_all``); on a 200 Mbit/s link that is 100 KB."""

MIN_PIECE_ELEMENTS = 16 * 1024


def piece_elements_for(bandwidth, element_bytes=4):
    """Elements per inter-host piece for a slowest link of ``bandwidth`` bytes/s (None when not
    measured: whole messages); at least ``MIN_PIECE_ELEMENTS``, so fast links send one piece."""
    if not bandwidth:
        return None
    return max(MIN_PIECE_ELEMENTS, int(bandwidth * PIECE_SECONDS) // element_bytes)


def reduction_decision(setting, enabled, hosts, dp_is_world):
    """Whether the hierarchical reduction is in force, and a note saying why not (or None).

    Args:
        setting: ``communication.hierarchical_reduction`` (True, False or "auto").
        enabled: ``heterogeneous_config.enabled``.
        hosts: host of each data-parallel rank, or None when unknown (one host).
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
    if not dp_is_world:
        if setting is True:
            raise ValueError("heterogeneous_config.communication.hierarchical_reduction is true, but the "
                             "data-parallel group is not the whole world (model or sequence parallelism), which the "
                             "hierarchical reduction does not cover; use \"auto\" or false")
        return False, "the data-parallel group is not the whole world (model or sequence parallelism)"
    return True, None


def settle(setting, why, key, where, reducer_present):
    """``(active, note)`` of a part that rides on the hierarchical reduction: on when nothing stands
    in its way (``why`` None) and it was not turned off; ``true`` where something does is a
    ValueError naming ``key`` and why, except without a reducer (one host), where there is nothing
    to act on and ``true`` is no error, as for ``hierarchical_reduction``. ``where``: what
    ``"auto"`` does, for the message."""
    if why is None:
        return True, None
    if setting is True and reducer_present:
        raise ValueError(f"heterogeneous_config.communication.{key} is true, but {why}; use \"auto\" ({where}) "
                         "or false")
    return False, why


def agree_on_features(dp_rank, features):
    """Every rank decided the communication features (overlap, the deferred parameter gather, host
    shards: ``features``, a tuple of flags) from the same facts; one gather checks it, since a rank
    that overlapped where its peers did not would pair no collective with them."""
    from ..cluster.agreement import Agreement
    everyone = Agreement(f"data-parallel rank {dp_rank}").gather_from_every_rank(
        tuple(features), "the communication features each rank decided (overlap, parameter gather, host shards)")
    differing = [rank for rank, flags in enumerate(everyone) if tuple(flags) != tuple(everyone[0])]
    if differing:
        raise RuntimeError(f"deepspeed-hetero: the ranks decided the communication features differently (overlap, "
                           f"overlap_parameter_gather, zero3_host_shards): global rank(s) {differing} "
                           f"{list(everyone[differing[0]])}, rank 0 {list(everyone[0])}; every input of the "
                           "decision must be the same on every rank")


def piece(tensor, index, pieces):
    """Piece ``index`` of ``tensor`` cut into ``pieces`` nearly equal pieces (the last ones may be
    shorter or empty)."""
    size = -(-tensor.numel() // pieces)
    start = min(index * size, tensor.numel())
    return tensor.narrow(0, start, min(size, tensor.numel() - start))


def scatter_into(block, parts):
    offset = 0
    for part in parts:
        part.copy_(block.narrow(0, offset, part.numel()).view_as(part))
        offset += part.numel()
