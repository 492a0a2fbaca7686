# SPDX-License-Identifier: Apache-2.0
"""Hierarchical gradient reduction and parameter all-gather on a cluster of several hosts.

Upstream all-reduces ZeRO-0/1/2 gradient buckets over one flat data-parallel group and gathers
ZeRO-1/2's updated parameters over it too, so the links between hosts, often ten times slower
than those inside one, carry as much as any in-host link. Here:

- **ZeRO-1/2 buckets** (``HierarchicalReducer.reduce_to_owners``): ZeRO all-reduces whole buckets
  although each rank reads only the slices of its own partition afterwards. The bucket is reduced
  to each host's leader, the leaders exchange only the slices the other hosts' ranks own (one
  all-to-all, cut into pieces of a few milliseconds of the slowest link), and each leader passes
  its host's slices on. On 2 hosts x 2 ranks a host's link carries half a bucket each way,
  against one and a half for a flat ring all-reduce.
- **ZeRO-1/2 updated parameters** (``all_gather_partitions``): each partition crosses a link once
  (inside the host, then one all-to-all between the leaders, then inside the host again), also
  when partitions differ in size (``heterogeneous_memory.zero_partitions``).
- **Other all-reduces** (ZeRO-0, ``reduce_scatter: false``; ``all_reduce``): on even hosts
  (every host has L ranks) a reduce-scatter inside each host, an all-reduce of shard j across the
  hosts among the ranks with local index j, an all-gather inside the host; on uneven hosts
  (e.g. 2 + 1) a reduce to each host's leader, an all-reduce among the leaders and a broadcast.

In floating point the results equal the flat collectives up to the order of the summation. The
optional compression (``compress_inter_host``) rounds only the inter-host step.

The pure parts (layouts, owned ranges, pieces, the decision) are in ``host_groups.py``; the
reducer creates its process groups
once, on every rank of the world in the same order (a creation that differs between ranks would
hang), and every collective goes through ``deepspeed.comm``, so the fork's comm clock and
collective log see each step.

Upstream reaches this module through ``all_reduce(tensor, group, owners)``, called instead of
``deepspeed.comm.all_reduce`` at the gradient all-reduce sites of ZeRO-1/2 (``stage_1_and_2.py``)
and ZeRO-0 (``engine.py``), and ``all_gather_dp_groups``, called instead of upstream's at
ZeRO-1/2's two parameter gathers; without a reducer for the group each is upstream's call, after
one branch on an empty dict.
"""

import torch

from deepspeed import comm as dist

from . import lossless, overlap, parameter_gather
from .host_groups import group_layout, host_ranges, pack, piece, ranges_numel, scatter_into, shard_size, unpack


COMPRESSION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSSLESS = "lossless"  # compress_inter_host's exact setting: the leaders' exchanges coded by lossless.py

_reducers = {}
"""Process group -> the HierarchicalReducer that all-reduces over it (registered by the engine's
``session.CommunicationSession``)."""


class HierarchicalReducer:
    """Sum-all-reduce over one data-parallel group, inside hosts first (see the module docstring).

    Construction creates process groups and must run on every rank of the world, in the same
    order relative to every other group creation."""

    def __init__(self, hosts, group=None, compress=False, piece_elements=None):
        """
        Args:
            hosts: host of each member of ``group`` (member order), e.g. (0, 0, 1, 1).
            group: the data-parallel process group (None: the world).
            compress: False, "bf16" or "fp16" (the dtype of the inter-host step), or "lossless"
                (the leaders' all-to-alls coded bit for bit, ``lossless.py``).
            piece_elements: the most elements the leaders' all-to-all sends a peer at once
                (``piece_elements_for``; None: whole messages). The same on every rank.
        """
        if piece_elements is not None and piece_elements < 1:
            raise ValueError(f"piece_elements must be a positive number of elements or None, got {piece_elements}")
        self.piece_elements = piece_elements
        self.background = None  # overlap.BackgroundReduction while ZeRO buckets are reduced during the backward
        self.layout = group_layout(hosts)
        self.group = group
        self.set_compression(compress)
        ranks = dist.get_all_ranks_from_group(group) if group is not None else list(range(dist.get_world_size()))
        if len(ranks) != len(self.layout.hosts):
            raise ValueError(f"hosts {list(hosts)} name {len(self.layout.hosts)} ranks but the data-parallel group "
                             f"has {len(ranks)}")
        self.ranks = tuple(ranks)
        self.member = ranks.index(dist.get_rank())
        self.host = host = self.layout.host_of(self.member)
        self.host_size = len(self.layout.host_members[host])
        self.leader = ranks[self.layout.leaders[host]]
        self.is_leader = self.leader == dist.get_rank()
        global_members = [[ranks[m] for m in members] for members in self.layout.host_members]
        self.intra_group, created = torch.distributed.new_subgroups_by_enumeration(global_members)
        self._created = list(created)  # every group this reducer made, destroyed by close()
        leaders = dist.new_group([ranks[m] for m in self.layout.leaders])
        self._created.append(leaders)
        self.leader_group = leaders if self.is_leader else None
        if self.layout.even:
            shards = [[ranks[m] for m in column] for column in self.layout.shard_groups]
            self.inter_group, created = torch.distributed.new_subgroups_by_enumeration(shards)
            self._created += list(created)
        else:
            self.inter_group = self.leader_group

    def close(self):
        """Stop what runs on this reducer's groups (the overlap worker, joined; a deferred parameter
        gather, finished) and destroy the process groups it created. Every rank closes alike (the
        engine's ``destroy``, or a new engine with other groups)."""
        overlap.attach(self, False, None)
        parameter_gather.detach_reducer(self)
        from torch.distributed import distributed_c10d
        for group in self._created:
            if isinstance(group, torch.distributed.ProcessGroup) and group in distributed_c10d._world.pg_map:
                torch.distributed.destroy_process_group(group)
        self._created = []
        self.intra_group = self.leader_group = self.inter_group = None

    def set_compression(self, compress):
        self.lossless = compress == LOSSLESS
        self.compress = COMPRESSION_DTYPES[compress] if compress and not self.lossless else None

    def all_reduce(self, tensor):
        """Sum ``tensor`` over the group, in place (as ``deepspeed.comm.all_reduce``)."""
        if tensor.numel() == 0:
            return
        parameter_gather.wait_for_reducer(self)  # the main thread's turn on the groups
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

    def reduce_to_owners(self, tensor, segments):
        """Sum ``tensor`` over the group, in place, where it is read afterwards: each slice of
        ``segments`` (``(numel, owners)`` in order, as ``host_ranges`` takes them) ends up summed
        on its owners; elsewhere the slice holds a partial sum, as after upstream's reduce to one rank.

        ZeRO-1/2 all-reduce whole buckets although each rank keeps only its own partition's
        slices. Here the sum goes to each host's leader, the leaders exchange only the slices the
        other hosts own (an all-to-all: with two hosts each sends half the bucket, against the one
        and a half buckets of a flat ring all-reduce), and each leader passes its host's slices
        to the host. The host partials are added in host order, so leaders that share a slice
        compute the same bits."""
        if tensor.numel() == 0:
            return
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        ranges = host_ranges(self.layout, segments)
        covered = sum(numel for numel, _ in segments)
        if covered != flat.numel():
            raise ValueError(f"segments cover {covered} elements of a tensor of {flat.numel()}")
        if self.host_size > 1:
            dist.reduce(flat, self.leader, group=self.intra_group)
        if self.is_leader:
            self._exchange_owned(flat, ranges)
        mine = ranges[self.host]
        if self.host_size > 1 and mine:
            packed = pack(flat, mine) if self.is_leader else flat.new_empty(ranges_numel(mine))
            dist.broadcast(packed, self.leader, group=self.intra_group)
            if not self.is_leader:
                unpack(packed, flat, mine)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))

    def reduce(self, tensor, segments):
        """``reduce_to_owners`` at upstream's call sites: while a ZeRO bucket is captured for, or
        replayed from, the background reduction (``overlap.py``), it goes there instead."""
        if self.background is not None and self.background.mode is not None:
            self.background.intercept(tensor, segments)
        else:
            parameter_gather.wait_for_reducer(self)  # the main thread's turn on the groups
            self.reduce_to_owners(tensor, segments)

    def _exchange_owned(self, flat, ranges):
        """Leaders only: send each other host the host partial of the slices it owns, receive the
        other hosts' partials of this host's slices, add them in host order."""
        dtype = self.compress or flat.dtype
        sends = [flat.new_empty(0, dtype=dtype) if host == self.host else pack(flat, owned).to(dtype)
                 for host, owned in enumerate(ranges)]
        wanted = ranges_numel(ranges[self.host])
        partials = self.leaders_all_to_all(sends, [0 if host == self.host else wanted for host in range(len(ranges))],
                                           largest=max(ranges_numel(owned) for owned in ranges))
        if not wanted:
            return
        partials[self.host] = pack(flat, ranges[self.host]).to(dtype)  # rounded alike when compressed
        total = partials[0].to(flat.dtype)
        for partial in partials[1:]:
            total.add_(partial.to(flat.dtype))
        unpack(total, flat, ranges[self.host])

    def leaders_all_to_all(self, sends, receive_sizes, largest):
        """Leaders only: ``sends[h]`` to host h's leader, ``receive_sizes[h]`` elements from it;
        returns what came, per host. ``largest`` (the same on every leader) bounds every send.

        One all-to-all, so every link carries its host's data out and the others' in at once, cut
        into pieces of at most ``piece_elements`` per peer when the link was measured: gloo sends a
        large message over a rate-limited link at about half the rate (measured on the emulated
        cluster at 200 Mbit/s: 1.68 MB each way took 134 ms in one message, 73 ms in 105 KB
        pieces, against 67 ms at the link's rate)."""
        received = [sends[0].new_empty(size) for size in receive_sizes]
        if largest == 0:
            return received
        pieces = 1 if not self.piece_elements else -(-largest // self.piece_elements)
        if not self.lossless:
            self._all_to_all_pieces(sends, received, pieces)
            return received
        # Lossless: every message coded, its size sent ahead; the pieces cut from the coded bytes
        # (their count still from ``largest``, the same on every leader).
        device = sends[0].device
        payloads = [lossless.encode(tensor).to(device) for tensor in sends]
        sizes = lossless.exchange_sizes([payload.numel() for payload in payloads], self.leader_group, device)
        arrived = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
        self._all_to_all_pieces(payloads, arrived, pieces)
        for output, payload in zip(received, arrived):
            output.copy_(lossless.decode(payload, output.dtype, output.numel()))
        return received

    def _all_to_all_pieces(self, sends, received, pieces):
        for index in range(pieces):
            inputs = [piece(tensor, index, pieces) for tensor in sends]
            outputs = [piece(tensor, index, pieces) for tensor in received]
            sizes = [output.numel() for output in outputs]
            arrived = sends[0].new_empty(sum(sizes))
            dist.all_to_all_single(arrived, torch.cat(inputs), output_split_sizes=sizes,
                                   input_split_sizes=[tensor.numel() for tensor in inputs], group=self.leader_group)
            for output, part in zip(outputs, arrived.split(sizes)):
                output.copy_(part)

    def all_gather_partitions(self, partitions):
        """Give every rank every member's partition (views of one flat buffer, in member order;
        this rank's own is up to date), crossing each link once per partition: inside the host
        each member broadcasts its partition, the leaders exchange their hosts' blocks (one
        all-to-all), and each leader broadcasts the other hosts' blocks inside its host.
        Partitions may differ in size (``heterogeneous_memory.zero_partitions``)."""
        parameter_gather.wait_for_reducer(self)  # the main thread's turn on the groups
        layout = self.layout
        if len(partitions) != len(layout.hosts):
            raise ValueError(f"{len(partitions)} partitions for a group of {len(layout.hosts)}")
        if self.host_size > 1:
            for member in layout.host_members[self.host]:
                dist.broadcast(partitions[member], self.ranks[member], group=self.intra_group)
        if self.is_leader:
            own = torch.cat([partitions[m] for m in layout.host_members[self.host]])
            sizes = [sum(partitions[m].numel() for m in members) for members in layout.host_members]
            sends = [own.new_empty(0) if host == self.host else own for host in range(layout.num_hosts)]
            wanted = [0 if host == self.host else size for host, size in enumerate(sizes)]
            blocks = self.leaders_all_to_all(sends, wanted, largest=max(sizes))
            for host, block in enumerate(blocks):
                if host != self.host:
                    scatter_into(block, [partitions[m] for m in layout.host_members[host]])
        if self.host_size > 1:
            others = [partitions[m] for m in range(len(partitions)) if layout.host_of(m) != self.host]
            block = torch.cat(others) if self.is_leader else others[0].new_empty(sum(p.numel() for p in others))
            dist.broadcast(block, self.leader, group=self.intra_group)
            if not self.is_leader:
                scatter_into(block, others)

    def _between_hosts(self, values):
        if self.compress is None or values.dtype == self.compress:
            dist.all_reduce(values, group=self.inter_group)
            return
        sent = values.to(self.compress)
        dist.all_reduce(sent, group=self.inter_group)
        values.copy_(sent)


def all_reduce(tensor, group=None, owners=None):
    """The gradient all-reduce (sum, in place) at upstream's data-parallel call sites: through the
    reducer the engine's session built for ``group``, else ``deepspeed.comm.all_reduce`` unchanged.

    ``owners`` (ZeRO-1/2's multi-rank buckets): ``(numel, owners)`` per consecutive slice, where
    only the owners read the slice afterwards; the reducer then sends each host only what it owns
    (``HierarchicalReducer.reduce_to_owners``)."""
    reducer = _reducers.get(group) if _reducers else None
    if reducer is None:
        return dist.all_reduce(tensor, group=group)
    if owners is None:
        reducer.all_reduce(tensor)
    else:
        reducer.reduce(tensor, owners)


def reduce_scatter(buffer, member, group=None):
    """ZeRO-3's batched gradient reduce-scatter (``reduce_scatter_coalesced``: ``buffer`` holds one
    equal chunk per member of ``group``, in member order) through the group's reducer, in place:
    afterwards chunk ``member`` holds the sum. Returns False, having done nothing, when no reducer
    is registered for ``group`` (upstream's reduce-scatter then runs)."""
    reducer = zero3_reducer(group)
    if reducer is None:
        return False
    members = len(reducer.layout.hosts)
    if buffer.numel() % members or member != reducer.member:
        raise ValueError(f"reduce_scatter: a buffer of {buffer.numel()} elements is not {members} equal chunks, or "
                         f"member {member} is not this rank's ({reducer.member})")
    chunk = buffer.numel() // members
    reducer.reduce(buffer, [(chunk, owner) for owner in range(members)])
    return True


def zero3_reducer(group):
    """The reducer for ZeRO-3's partition ``group``, or None. ZeRO-3 partitions parameters over
    the world group object when the data-parallel group is the whole world (the only case
    the session registers a reducer for)."""
    if not _reducers:
        return None
    reducer = _reducers.get(group)
    if reducer is None and (group is None or group == dist.get_world_group()):
        reducer = next((r for r in _reducers.values() if len(r.ranks) == dist.get_world_size()), None)
    return reducer


def all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor,
                         allgather_bucket_size, defer=False):
    """Upstream's ``all_gather_dp_groups`` (the updated parameters of ZeRO-1/2 to every rank), each
    group with a reducer gathered through it (``HierarchicalReducer.all_gather_partitions``).
    ``defer`` (the step's call site): hand it to the overlap worker when
    ``communication.overlap_parameter_gather`` is in force (``parameter_gather.py``)."""
    from deepspeed.runtime.utils import all_gather_dp_groups as flat_all_gather
    if defer and parameter_gather.started(partitioned_param_groups):
        return
    parameter_gather.wait_for(partitioned_param_groups)
    rest = [i for i, group in enumerate(dp_process_group[:len(partitioned_param_groups)])
            if not _reducers or _reducers.get(group) is None]
    for i, parts in enumerate(partitioned_param_groups):
        if i not in rest:
            _reducers[dp_process_group[i]].all_gather_partitions(parts)
    if rest:
        flat_all_gather(groups_flat=[groups_flat[i] for i in rest],
                        partitioned_param_groups=[partitioned_param_groups[i] for i in rest],
                        dp_process_group=[dp_process_group[i] for i in rest],
                        start_alignment_factor=start_alignment_factor, allgather_bucket_size=allgather_bucket_size)


def reducer_for(group):
    """The reducer in force for ``group``, or None."""
    return _reducers.get(group)
