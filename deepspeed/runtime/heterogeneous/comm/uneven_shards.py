# SPDX-License-Identifier: Apache-2.0
"""The collectives of memory-proportional ZeRO-3 shards (``memory/zero3_shards.py``): slices of one
parameter that differ in size from rank to rank.

- ``gather``: the all-gather of a bucket of parameters. Two ways, and the choice is per bucket
  from the slice sizes alone (so every rank makes the same one): ``pad`` — each rank's
  contribution padded to the largest, one ``all_gather_into_tensor`` (upstream's single
  collective; a ring moves ``(world-1) * largest`` elements to each rank); ``owners`` — one
  broadcast per owner of exactly its slices (``sum - own`` elements to each rank, ``world``
  collectives). ``pad`` is kept while ``(world-1) * largest <= sum`` (always for 2 ranks),
  ``owners`` otherwise. ``gather_coalesced`` and ``gather_listed`` are what upstream's
  ``all_gather_coalesced`` and ``Init._all_gather`` hand over; ``gather_partition`` gathers one
  full fp32 state (``safe_get_full_fp32_param``).
- ``reduce_scatter``: the gradients' counterpart (a padded reduce-scatter, or one reduce per
  owner), pre-divided by the world size as upstream's ``reduce_scatter_coalesced``; through the
  hierarchical reducer when one is registered for the group (multi-host runs), which takes uneven
  chunks as they are.

Every rank must pass the same parameters in the same order.
"""

import torch

from ..memory.zero3_shards import param_spans, valid_numel
from .gather_handles import MultipleHandles, UnevenGatherHandle, choose_mode


def _contributions(params, world):
    spans = [param_spans(p, world) for p in params]
    return spans, [sum(s[rank][1] for s in spans) for rank in range(world)]


@torch.no_grad()
def gather(params, group, device, available_status, async_op=True):
    """All-gather ``params`` (partitioned, not available, one dtype) whose slices may differ in
    size across ranks; returns an ``UnevenGatherHandle``. Every rank must pass the same parameters
    in the same order."""
    from deepspeed import comm as dist
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    dtype = params[0].ds_tensor.dtype
    spans, sizes = _contributions(params, world)
    own = [p.ds_tensor.to(device).to(dtype).view(-1) for p in params]
    if choose_mode(sizes, world) == "pad":
        largest = max(sizes)
        flat = torch.empty(largest * world, dtype=dtype, device=device)
        pieces = [flat.narrow(0, r * largest, largest) for r in range(world)]
        torch.cat(own, out=pieces[rank].narrow(0, 0, sizes[rank]))
        works = [dist.allgather_fn(flat, pieces[rank], group=group, async_op=async_op)]
    else:
        pieces = [torch.empty(sizes[r], dtype=dtype, device=device) for r in range(world)]
        torch.cat(own, out=pieces[rank])
        works = [
            dist.broadcast(pieces[r], dist.get_global_rank(group, r), group=group, async_op=async_op)
            for r in range(world)
        ]
    handle = UnevenGatherHandle(params, spans, pieces, works if async_op else [], available_status)
    if not async_op:
        handle.wait()
    return handle


def gather_coalesced(params, group, device, available_status):
    """``all_gather_coalesced`` of parameters (already marked in flight, sorted) of which some
    have uneven slices: one gather per dtype, as upstream's."""
    by_dtype = {}
    for param in params:
        by_dtype.setdefault(param.ds_tensor.dtype, []).append(param)
    handles = [gather(group_params, group, device, available_status) for group_params in by_dtype.values()]
    return handles[0] if len(handles) == 1 else MultipleHandles(handles)


def gather_listed(params, partition_group_of, device, status, async_op):
    """``Init._all_gather``: gather those of ``params`` that are not available (in ``ds_id``
    order, per partition group and dtype). Returns the handles when ``async_op``, else None with
    the parameters available."""
    todo = sorted((p for p in params if p.ds_status == status.NOT_AVAILABLE), key=lambda p: p.ds_id)
    by_group = {}
    for param in todo:
        param.ds_status = status.INFLIGHT
        by_group.setdefault(id(partition_group_of(param)), []).append(param)
    handles = [gather_coalesced(group_params, partition_group_of(group_params[0]), device, status.AVAILABLE)
               for group_params in by_group.values()]
    if async_op:
        return handles
    for handle in handles:
        handle.wait()
    return None


@torch.no_grad()
def gather_partition(param, partition, group):
    """The full tensor of which ``partition`` (this rank's slice of ``param``, any dtype: the fp32
    master copy, an optimizer state, a gradient) is one slice, on every rank."""
    from deepspeed import comm as dist
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    spans = param_spans(param, world)
    sizes = [size for _, size in spans]
    largest = max(sizes)
    flat = torch.zeros(largest * world, dtype=partition.dtype, device=partition.device)
    flat.narrow(0, rank * largest, sizes[rank]).copy_(partition.detach().reshape(-1)[:sizes[rank]])
    dist.all_gather_into_tensor(flat, flat.narrow(0, rank * largest, largest), group=group)
    parts = [flat.narrow(0, r * largest + 0, valid_numel(param, start, size)) for r, (start, size) in enumerate(spans)]
    return torch.cat(parts).view(param.ds_shape)


@torch.no_grad()
def reduce_scatter(params, grads, group):
    """Sum ``grads`` (full, one per parameter) over ``group`` and return this rank's slice of each,
    pre-divided by the group size as upstream's ``reduce_scatter_coalesced`` (slices of equal
    partitions are cut to the part inside the parameter, as upstream's are)."""
    from deepspeed import comm as dist
    from . import hierarchical
    world, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    spans, sizes = _contributions(params, world)
    dtype, device = grads[0].dtype, grads[0].device

    def fill(buffer, owner, base):
        """Write ``owner``'s slice of every gradient into ``buffer`` from ``base`` (padding zeroed)."""
        offset = base
        for param, grad, param_spans_ in zip(params, grads, spans):
            start, size = param_spans_[owner]
            keep = valid_numel(param, start, size)
            if keep:
                buffer.narrow(0, offset, keep).copy_(grad.reshape(-1).narrow(0, start, keep))
            if size - keep:
                buffer.narrow(0, offset + keep, size - keep).zero_()
            offset += size
        return offset

    # One buffer, written in place: no copy of a bucket is made twice.
    reducer = hierarchical.zero3_reducer(group)
    if reducer is not None:
        buffer = torch.empty(sum(sizes), dtype=dtype, device=device)
        for owner in range(world):
            fill(buffer, owner, sum(sizes[:owner]))
        reducer.reduce(buffer.div_(world), [(sizes[r], r) for r in range(world)])
        mine = buffer.narrow(0, sum(sizes[:rank]), sizes[rank])
    elif choose_mode(sizes, world) == "pad":
        largest = max(sizes)
        buffer = torch.empty(largest * world, dtype=dtype, device=device)
        for owner in range(world):
            end = fill(buffer, owner, owner * largest)
            buffer.narrow(0, end, (owner + 1) * largest - end).zero_()
        mine = torch.empty(largest, dtype=dtype, device=device)
        dist.reduce_scatter_fn(mine, buffer.div_(world), group=group)
        del buffer
    else:
        mine = None
        for owner in range(world):
            chunk = torch.empty(sizes[owner], dtype=dtype, device=device)
            fill(chunk, owner, 0)
            dist.reduce(chunk.div_(world), dist.get_global_rank(group, owner), group=group)
            if owner == rank:
                mine = chunk
    out, offset = [], 0
    for param, param_spans_ in zip(params, spans):
        start, size = param_spans_[rank]
        keep = valid_numel(param, start, size)
        out.append(mine.narrow(0, offset, keep))
        offset += size
    return out


@torch.no_grad()
def repartition(params, layout, world_size):
    """Cut ``params`` (ZeRO-3 parameters, partitioned, before the optimizer holds their slices) by
    ``layout`` (a ``ShardLayout``, or None for upstream's equal slices), one parameter at a time: it is
    gathered whole from its current slices and cut again, so a rank holds one whole parameter at
    most beyond its slices. Parameters partitioned over another group (experts) and those whose
    slices do not change are left alone. Every rank must pass the same parameters in the same order
    and the same layout (the slices decide which parameters move, so every rank moves the same).
    Returns ``(parameters moved, elements moved)``."""
    from ..memory.zero3_shards import init_param
    moved = elements = 0
    for param in params:
        if int(param.ds_zero_partition_world_size) != int(world_size):
            continue
        spans = None if layout is None else layout.spans(param.ds_numel)
        if spans == getattr(param, "ds_shard_spans", None):
            param.ds_shard_layout = layout  # as init_param: a parameter too small to cut keeps it too
            continue
        param.all_gather()
        param.ds_tensor = None  # its old slice: _partition_param allocates the new one
        init_param(param, layout, world_size)
        param.partition()
        moved, elements = moved + 1, elements + int(param.ds_numel)
    return moved, elements
