# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3 parameter gathers that stay inside the host.

Upstream ZeRO-3 gathers every parameter from the primary shards of every rank, so each forward
(and each backward re-gather) crosses the slow inter-host link. Here each host keeps one full copy
of the bit16 (or fp32) parameters, cut among its ranks: the **host shard** of a rank is a
contiguous span of each parameter (``host_shard_plan.host_spans``). A gather then runs inside the
host only.

- **Refresh.** After the primaries change (the optimizer step writes them, a checkpoint loads them,
  ``GatheredParameters`` writes a modified parameter back), their host shards are stale; a gather
  of stale parameters refreshes them first with ``all_to_all_single`` over the data-parallel
  group: rank j sends rank r the part of its primary slices that lies in r's host spans
  (``host_shard_plan.exchange_plan``). Each element crosses the link once per other host: on 2
  hosts x 2 ranks, N/2 each way, where upstream's forward all-gather moves 1.5 N over gloo. Every
  rank reaches that gather at the same point (ZeRO-3's gathers are collective), and staleness is set
  by the same events on every rank, so every rank runs the same collectives.
- **Chunks.** A gather's stale parameters are refreshed in chunks of about
  ``REFRESH_CHUNK_BYTES``, in ``ds_id`` order, each an asynchronous all-to-all started when the
  gather is. Upstream's coordinator waits parameter by parameter (``wait``, hooked in
  partitioned_param_coordinator.py): a parameter waits only for the chunks up to its own, so the
  layers of a prefetched bucket compute while the later chunks still cross the link.
- **Gather.** Upstream's ``all_gather_coalesced`` hands a bucket over (``serves``) when every
  parameter in it has a host shard: one all-gather on a dedicated in-host group (not the
  reducer's groups, which the overlapped reduction may be using on its thread); a host of one
  rank copies its shard. The result is the same bits as the flat gather: values are only copied.
- **Spans.** A host's span of each parameter is cut among its ranks in proportion to their
  primary slices (equal for upstream's equal slices, the memory shares with
  ``heterogeneous_memory.zero_partitions``), so a rank holds about
  ``numel * share / host share`` more elements: the memory pool counts them (``memory/spec.py``,
  ``peak.py``, ``pool.py``). A host shard keeps the dtype upstream gathers in (the partition's, or
  torch autocast's communication dtype).

Configured by ``heterogeneous_config.communication.zero3_host_shards``
(``host_shard_plan.host_shards_decision``).
"""

import collections

import torch

from deepspeed.utils import logger

from ..memory.zero3_shards import CHUNKS_IN_FLIGHT, REFRESH_CHUNK_BYTES, param_spans  # noqa: F401 (tests set them here)
from . import lossless as lossless_coding
from .gather_handles import MultipleHandles, UnevenGatherHandle, choose_mode
from .host_shard_plan import exchange_plan, host_shards_decision, zero_settings

ATTRIBUTE = "ds_host_shards"
"""The ``HostShards`` a parameter belongs to (None or absent: gathered flat)."""


class HostShards:
    """The host shards of one engine's ZeRO-3 parameters (see the module docstring)."""

    def __init__(self, params, group, layout, gather_group, device, lossless=False):
        from deepspeed import comm as dist
        self.group, self.gather_group, self.device = group, gather_group, device
        self.world = dist.get_world_size(group=group)
        self.rank = dist.get_rank(group=group)
        self.host_members = layout.host_members
        # compress_inter_host "lossless": what goes to a rank of another host is coded (lossless.py)
        self.coded_peers = ([layout.host_of(peer) != layout.host_of(self.rank) for peer in range(self.world)]
                            if lossless else None)
        self.members = self.host_members[layout.host_of(self.rank)]
        self.local = self.members.index(self.rank)
        self.params = sorted(params, key=lambda p: p.ds_id)
        self.new_round = True  # parameters went stale since the last refresh began
        self.refreshes = 0  # refresh rounds: the first gathers after each change of the primaries
        # Every RefreshingGather's chunks not yet completed, (handle, chunk index) in the order the
        # gathers were started: the same on every rank, and completed only from the front.
        self.pending = collections.deque()
        self.in_flight = 0
        # What this rank sends and receives of each parameter: indexed by peer, (offset, elements)
        # in its primary slice (sends) or its host shard (receives), or None.
        self.sends, self.receives = {}, {}
        self.exchanges = {}  # see exchange()
        by_dtype = {}
        for param in self.params:
            by_dtype.setdefault(gather_dtype(param), []).append(param)
        for dtype, listed in by_dtype.items():
            spans, pieces = exchange_plan([p.ds_numel for p in listed], [param_spans(p, self.world) for p in listed],
                                          self.host_members, only=self.rank)
            for param in listed:
                self.sends[param], self.receives[param] = [None] * self.world, [None] * self.world
            for peer in range(self.world):
                for k, source, _, n in pieces[self.rank][peer]:
                    self.sends[listed[k]][peer] = (source, n)
                for k, _, target, n in pieces[peer][self.rank]:
                    self.receives[listed[k]][peer] = (target, n)
            for param, param_spans_ in zip(listed, spans):
                param.ds_host_spans = tuple(param_spans_[m] for m in self.members)
                param.ds_host_shard = torch.empty(param_spans_[self.rank][1], dtype=dtype, device=device)
                param.ds_host_stale = True
                param.ds_host_generation = 0
                setattr(param, ATTRIBUTE, self)

    def held_elements(self):
        return sum(p.ds_host_shard.numel() for p in self.params if getattr(p, ATTRIBUTE, None) is self)

    def mark_stale(self, param):
        param.ds_host_stale = True
        param.ds_host_generation += 1  # a refresh already started for it does not make it fresh
        self.new_round = True

    def exchange(self, params):
        """What refreshing ``params`` (one dtype, in ``ds_id`` order) moves, worked out once per set
        (a gather's chunks are the same every step): the split sizes to and from each rank, and the
        copies into the send buffer and out of the receive buffer, ``(param, offset, elements)``."""
        key = tuple(p.ds_id for p in params)
        plan = self.exchanges.get(key)
        if plan is None:
            in_sizes = [sum(self.sends[p][r][1] for p in params if self.sends[p][r]) for r in range(self.world)]
            out_sizes = [sum(self.receives[p][j][1] for p in params if self.receives[p][j]) for j in range(self.world)]
            packs = [(p, *self.sends[p][r]) for r in range(self.world) for p in params if self.sends[p][r]]
            unpacks = [(p, *self.receives[p][j]) for j in range(self.world) for p in params if self.receives[p][j]]
            plan = self.exchanges[key] = (in_sizes, out_sizes, packs, unpacks)
        return plan

    @torch.no_grad()
    def start_refresh(self, params):
        """Start the all-to-all that refreshes the host shards of ``params`` (stale, sorted by
        ``ds_id``, one dtype); returns what ``finish_refresh`` completes. Every rank of a host sends
        to every rank of the others at once, so the link carries several flows (on 2 x 2, four each
        way)."""
        from deepspeed import comm as dist
        dtype = params[0].ds_host_shard.dtype
        in_sizes, out_sizes, packs, unpacks = self.exchange(params)
        send = torch.empty(sum(in_sizes), dtype=dtype, device=self.device)
        offset = 0
        for param, source, n in packs:
            send.narrow(0, offset, n).copy_(param.ds_tensor.view(-1).narrow(0, source, n))
            offset += n
        if self.coded_peers is not None:
            return self._start_coded(params, send, in_sizes, out_sizes, unpacks)
        received = torch.empty(sum(out_sizes), dtype=dtype, device=self.device)
        work = dist.all_to_all_single(received, send, output_split_sizes=out_sizes, input_split_sizes=in_sizes,
                                      group=self.group, async_op=True)
        return params, [p.ds_host_generation for p in params], unpacks, send, received, work, None

    def _start_coded(self, params, send, in_sizes, out_sizes, unpacks):
        """``start_refresh`` with the parts for other hosts coded: their sizes go first (one small
        all-to-all, waited for here), then the bytes, asynchronously."""
        from deepspeed import comm as dist
        payloads = [lossless_coding.encode(part).to(self.device) if coded else part.view(torch.uint8)
                    for part, coded in zip(send.split(in_sizes), self.coded_peers)]
        sizes = lossless_coding.exchange_sizes([p.numel() for p in payloads], self.group, self.device)
        received = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        send = torch.cat(payloads)
        work = dist.all_to_all_single(received, send, output_split_sizes=sizes,
                                      input_split_sizes=[p.numel() for p in payloads], group=self.group, async_op=True)
        return params, [p.ds_host_generation for p in params], unpacks, send, received, work, (sizes, out_sizes)

    def _decoded(self, received, sizes, out_sizes, dtype):
        values = torch.empty(sum(out_sizes), dtype=dtype, device=self.device)
        offset = 0
        for part, n, coded in zip(received.split(sizes), out_sizes, self.coded_peers):
            target = values.narrow(0, offset, n)
            if coded:
                target.copy_(lossless_coding.decode(part, dtype, n))
            else:  # in-host bytes as sent (copied: a part need not start at an element boundary)
                target.view(torch.uint8).copy_(part)
            offset += n
        return values

    @torch.no_grad()
    def finish_refresh(self, started):
        from deepspeed.accelerator import get_accelerator
        params, generations, unpacks, _, received, work, coded = started  # the send buffer lives until here
        work.wait()
        if coded is not None:
            received = self._decoded(received, *coded, params[0].ds_host_shard.dtype)
        if received.device.type != "cpu":  # read below on this stream; freed once the chunk completes
            received.record_stream(get_accelerator().current_stream())
        offset = 0
        for param, target, n in unpacks:
            param.ds_host_shard.narrow(0, target, n).copy_(received.narrow(0, offset, n))
            offset += n
        for param, generation in zip(params, generations):
            if param.ds_host_generation == generation:
                param.ds_host_stale = False

    def start_ahead(self):
        """Start the refreshes of the oldest pending chunks not started yet, up to
        ``CHUNKS_IN_FLIGHT`` running (the same chunks on every rank: the queue is)."""
        for handle, index in self.pending:
            if self.in_flight >= CHUNKS_IN_FLIGHT:
                break
            if handle.started[index] is None:
                handle.started[index] = [self.start_refresh(listed) for listed in handle.stale_by_dtype(index)]
                self.in_flight += 1

    def complete_oldest(self):
        """Complete the oldest pending chunk: its refresh, then its in-host gather."""
        handle, index = self.pending.popleft()
        if handle.started[index] is None:
            handle.started[index] = [self.start_refresh(listed) for listed in handle.stale_by_dtype(index)]
            self.in_flight += 1
        for started in handle.started[index]:
            self.finish_refresh(started)
        started = handle.started[index] = ()  # its buffers freed before the next chunk starts
        self.in_flight -= 1
        self.start_ahead()
        self.gather_in_host(handle.chunks[index], handle.available_status).wait()
        handle.done = index + 1
        handle.complete = handle.done == len(handle.chunks)

    def gather(self, params, available_status):
        """All-gather ``params`` (in flight, sorted by ``ds_id``, all served by this instance) from
        the host shards; returns a handle as upstream's ``all_gather_coalesced`` does. Stale
        parameters are refreshed first, in chunks (``RefreshingGather``)."""
        if not any(p.ds_host_stale for p in params):
            return self.gather_in_host(params, available_status)
        if self.new_round:
            self.refreshes += 1
            self.new_round = False
        chunks, chunk, stale_bytes = [], [], 0
        for param in params:
            chunk.append(param)
            if param.ds_host_stale:
                stale_bytes += param.ds_numel * param.ds_host_shard.element_size()
            if stale_bytes >= REFRESH_CHUNK_BYTES or param is params[-1]:
                chunks.append(chunk)
                chunk, stale_bytes = [], 0
        handle = RefreshingGather(self, chunks, available_status)
        self.pending.extend((handle, index) for index in range(len(chunks)))
        self.start_ahead()
        return handle

    @torch.no_grad()
    def gather_in_host(self, params, available_status):
        """All-gather ``params``, fresh, from the host shards on the in-host group."""
        from deepspeed import comm as dist
        handles = []
        by_dtype = {}
        for param in params:
            by_dtype.setdefault(param.ds_host_shard.dtype, []).append(param)
        for dtype, listed in by_dtype.items():
            spans = [p.ds_host_spans for p in listed]
            sizes = [sum(s[m][1] for s in spans) for m in range(len(self.members))]
            own = [p.ds_host_shard for p in listed]
            if len(self.members) == 1:
                pieces, works = [torch.cat(own)], []
            elif choose_mode(sizes, len(self.members)) == "pad":
                largest = max(sizes)
                flat = torch.empty(largest * len(self.members), dtype=dtype, device=self.device)
                pieces = [flat.narrow(0, m * largest, largest) for m in range(len(self.members))]
                torch.cat(own, out=pieces[self.local].narrow(0, 0, sizes[self.local]))
                works = [dist.allgather_fn(flat, pieces[self.local], group=self.gather_group, async_op=True)]
            else:
                pieces = [torch.empty(sizes[m], dtype=dtype, device=self.device) for m in range(len(self.members))]
                torch.cat(own, out=pieces[self.local])
                works = [
                    dist.broadcast(pieces[m], dist.get_global_rank(self.gather_group, m), group=self.gather_group,
                                   async_op=True) for m in range(len(self.members))
                ]
            handles.append(UnevenGatherHandle(listed, spans, pieces, works, available_status))
        if len(handles) == 1:
            return handles[0]
        return MultipleHandles(handles)

    def move(self, device):
        """Move every host shard to ``device`` (upstream's ``offload_states`` moves the bit16
        partitions to the host and ``reload_states`` back; the host shards follow them). No
        collective: the values stay fresh."""
        self.device = device
        for param in self.params:
            if getattr(param, ATTRIBUTE, None) is self:
                param.ds_host_shard = param.ds_host_shard.to(device)

    def release(self):
        for param in self.params:
            if getattr(param, ATTRIBUTE, None) is self:
                setattr(param, ATTRIBUTE, None)
                param.ds_host_shard = None
                param.ds_host_spans = None


class RefreshingGather:
    """A gather whose host shards are refreshed chunk by chunk. Its chunks join the host shards'
    queue of pending chunks (``HostShards.pending``), which completes them only from the front,
    each as its refresh then its in-host gather: ``wait_param`` completes the queue up to a
    parameter's chunk, ``wait`` up to this gather's last. Whichever parameter a rank's coordinator
    waits for first (it iterates a set), every rank runs the in-host gathers and starts the
    refreshes in the queue's order, also where a module's parameters lie in two gathers."""

    def __init__(self, shards, chunks, available_status):
        self.shards, self.chunks = shards, chunks
        self.available_status = available_status
        self.chunk_of = {param: index for index, chunk in enumerate(chunks) for param in chunk}
        self.started = [None] * len(chunks)  # per chunk: None (not started), its refreshes, or () (done)
        self.done = 0
        self.complete = False

    def stale_by_dtype(self, index):
        """The chunk's stale parameters, one list per dtype, in a fixed order of dtypes."""
        by_dtype = {}
        for param in self.chunks[index]:
            if param.ds_host_stale:
                by_dtype.setdefault(param.ds_host_shard.dtype, []).append(param)
        return [by_dtype[dtype] for dtype in sorted(by_dtype, key=str)]

    def wait_param(self, param):
        self._complete_through(self.chunk_of[param])

    def wait(self, handle_dependency=True) -> None:
        self._complete_through(len(self.chunks) - 1)

    def _complete_through(self, last):
        while self.done <= last:
            self.shards.complete_oldest()


def wait(handle, param, handle_dependency=True):
    """Wait until ``param`` is gathered (upstream's coordinator, parameter by parameter): only as far
    as its own chunk where host shards are being refreshed, else the whole handle."""
    if isinstance(handle, RefreshingGather):
        handle.wait_param(param)
    else:
        handle.wait(handle_dependency=handle_dependency)


def serves(params):
    """The ``HostShards`` that gathers every one of ``params``, or None (upstream's gather)."""
    owner = getattr(params[0], ATTRIBUTE, None)
    if owner is None or any(getattr(p, ATTRIBUTE, None) is not owner for p in params):
        return None
    return owner


def _owners(params):
    owners = []
    for param in params:
        owner = getattr(param, ATTRIBUTE, None)
        if owner is not None and all(owner is not known for known in owners):
            owners.append(owner)
    return owners


def move(params, device):
    """The host shards of ``params`` follow their partitions to ``device`` (``offload_states``,
    ``reload_states``)."""
    for owner in _owners(params):
        owner.move(device)


def release(params):
    """``params`` gather over every rank again and their host shards are freed (the optimizer is
    destroyed)."""
    for owner in _owners(params):
        owner.release()


def invalidate(params):
    """The primary slices of ``params`` changed: their host shards are refreshed before the next
    gather (called on every rank alike: the optimizer step, a load, a modified parameter written
    back)."""
    for param in params:
        owner = getattr(param, ATTRIBUTE, None)
        if owner is not None:
            owner.mark_stale(param)


def gather_dtype(param):
    """The dtype upstream gathers ``param`` in (``partition_parameters.get_allgather_dtype``): its
    partition's, or the communication dtype torch autocast gives it; the host shard keeps that
    dtype, so a gather returns the bits upstream's would (cast back to the partition's dtype)."""
    from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype
    return get_comm_dtype(param) if has_comm_dtype(param) else param.ds_tensor.dtype


def _gather_group(reducer):
    """A dedicated in-host group per reducer (created once, on every rank alike)."""
    group = getattr(reducer, "host_gather_group", None)
    if group is None:
        members = [[reducer.ranks[m] for m in host] for host in reducer.layout.host_members]
        group, _ = torch.distributed.new_subgroups_by_enumeration(members)
        reducer.host_gather_group = group
    return group


def attach(engine, reducer, setting, serves=None):
    """Give the ZeRO-3 engine's partitioned parameters host shards when ``host_shards_decision``
    says so (every rank alike); parameters an earlier engine gave host shards go back to the flat
    gather first. Returns the ``HostShards`` or None, and the note of why not.

    ``serves(group)``: whether ``reducer`` reduces the gradients of parameters partitioned over
    ``group``; parameters partitioned over another group (and persistent ones, which upstream
    gathers once after each step by its own path) keep upstream's gather."""
    from deepspeed.accelerator import get_accelerator
    module = engine.module
    for param in module.parameters():
        owner = getattr(param, ATTRIBUTE, None)
        if owner is not None:
            owner.release()
    stage = engine.zero_optimization_stage()
    moe = any(getattr(p, "allreduce", True) is False for p in module.parameters())
    active, note = host_shards_decision(setting, stage, reducer, *zero_settings(engine._config.zero_config), moe,
                                        bool(getattr(engine.optimizer, "zenflow", False)))
    if not active:
        return None, note
    group = reducer.group
    params = [p for p in module.parameters() if hasattr(p, "ds_id") and getattr(p, "ds_tensor", None) is not None
              and not getattr(p, "ds_persist", False) and (serves is None or serves(p.ds_process_group))]
    if not params:
        return None, "no partitioned parameters"
    shards = HostShards(params, group, reducer.layout, _gather_group(reducer), get_accelerator().current_device_name(),
                        lossless=getattr(reducer, "lossless", False))
    logger.debug(f"host shards: {shards.held_elements()} elements on this rank")
    return shards, None
