# SPDX-License-Identifier: Apache-2.0
"""The pure parts of ZeRO-3 host shards (``host_shards.py``), computed alike on every rank.

- **Spans.** ``host_spans`` and ``param_host_spans`` cut each parameter among a host's ranks in
  proportion to their primary slices: a rank's host shard is one contiguous span.
- **The refresh's plan.** ``exchange_plan`` says which elements each rank's primary slices send to
  which rank's host span; ``link_elements`` counts those that cross hosts.
- **Whether host shards apply.** ``host_shards_decision`` (at the engine, with the model) and
  ``expected`` (for the memory pool, before the engine exists) from the same settings
  (``zero_settings``).
"""

from .host_groups import group_layout, settle


def host_spans(numel, weights):
    """Cut ``numel`` elements into contiguous ``(start, size)`` spans, one per weight, in proportion
    to ``weights`` (non-negative, not all zero); the spans cover ``[0, numel)`` exactly."""
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"weights {list(weights)} must have a positive sum")
    bounds, cumulative = [0], 0
    for weight in weights:
        cumulative += weight
        bounds.append(numel * cumulative // total)
    return tuple((bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(weights)))


def param_host_spans(numel, primary, members):
    """Each member's span of one parameter inside its host: the host's members (indices into
    ``primary``, the ``(start, size)`` primary slice of every rank) share the whole parameter in
    proportion to the elements their primary slices hold."""
    weights = [valid_numel_of(numel, *primary[m]) for m in members]
    if sum(weights) == 0:
        weights = [1] * len(members)
    return host_spans(numel, weights)


def valid_numel_of(numel, start, size):
    return max(0, min(size, numel - start))


def exchange_plan(numels, primaries, host_members, only=None):
    """What the refresh moves, computed alike on every rank.

    Args:
        numels: elements of each parameter.
        primaries: for each parameter, every rank's ``(start, size)`` primary slice (``size`` may
            reach past the parameter: upstream's padding).
        host_members: the ranks (indices of the data-parallel group) of each host.
        only: a rank: fill only what it sends and receives (``pieces[only][r]`` and
            ``pieces[j][only]``; a rank needs no more, and the whole plan grows with the square of
            the world); None: every pair.

    Returns ``(spans, pieces)``: ``spans[k][r]`` is rank r's ``(start, size)`` host span of
    parameter k; ``pieces[j][r]`` lists ``(k, source_offset, target_offset, length)``: the elements
    of parameter k that rank j holds (from ``source_offset`` in its primary slice) and rank r's host
    span needs (from ``target_offset`` in r's host shard), in parameter order."""
    world = sum(len(m) for m in host_members)
    spans = []
    for numel, primary in zip(numels, primaries):
        if len(primary) != world:
            raise ValueError(f"{len(primary)} primary slices for a group of {world} ranks")
        of_rank = [None] * world
        for members in host_members:
            for member, span in zip(members, param_host_spans(numel, primary, members)):
                of_rank[member] = span
        spans.append(tuple(of_rank))
    pieces = [[[] for _ in range(world)] for _ in range(world)]
    pairs = [(j, r) for j in range(world) for r in range(world)] if only is None else (
        [(only, r) for r in range(world)] + [(j, only) for j in range(world) if j != only])
    for j, r in pairs:
        for k, (numel, primary) in enumerate(zip(numels, primaries)):
            start, size = primary[j]
            end = start + valid_numel_of(numel, start, size)
            span_start, span_size = spans[k][r]
            low, high = max(start, span_start), min(end, span_start + span_size)
            if high > low:
                pieces[j][r].append((k, low - start, low - span_start, high - low))
    return spans, pieces


def link_elements(pieces, hosts):
    """Elements the refresh sends across hosts, per host (both directions summed), from a whole
    plan (``exchange_plan`` with ``only=None``)."""
    crossing = [0] * (max(hosts) + 1)
    for j, row in enumerate(pieces):
        for r, listed in enumerate(row):
            if hosts[j] != hosts[r]:
                n = sum(length for *_, length in listed)
                crossing[hosts[j]] += n
                crossing[hosts[r]] += n
    return crossing


def host_shards_decision(setting, stage, reducer, hpz, offload_param, quantized, moe, zenflow=False):
    """Whether ZeRO-3 parameters are gathered inside the host, and a note saying why not.

    Every input is the same on every rank (agreed settings, the config, the model). ``true`` where
    it cannot apply raises ValueError naming the key; with one host (no reducer) there is nothing to
    keep inside a host and ``true`` is not an error, as for ``hierarchical_reduction``."""
    if setting is False or stage != 3:
        return False, None
    why = None
    if reducer is None:
        why = "the hierarchical reduction is not in force (one host, or hierarchical_reduction false)"
    elif hpz:
        why = "zero_hpz_partition_size keeps upstream's secondary shards (set it to 1, or this to false)"
    elif offload_param:
        why = "offload_param keeps the parameters off the accelerator (host shards would put N/ranks-per-host back)"
    elif quantized:
        why = "quantized weights gather through upstream's quantizer"
    elif moe:
        why = "expert parameters are partitioned over the expert data-parallel groups"
    elif zenflow:
        why = "ZenFlow updates the partitions during the backward"
    return settle(setting, why, "zero3_host_shards", "host shards where they apply", reducer is not None)


def expected(communication, zero, hosts):
    """Whether a ZeRO-3 engine under these settings will keep host shards, as the memory pool plans
    before the engine exists: ``communication`` (the fork's block), ``zero`` (upstream's
    ``zero_optimization`` config), ``hosts`` (the host of each data-parallel rank, or None). The
    same conditions as ``attach`` short of the model (MoE) and the data-parallel group."""
    if communication.zero3_host_shards is False or communication.hierarchical_reduction is False:
        return False
    if not hosts or not group_layout(hosts).useful or int(zero.stage) != 3:
        return False
    hpz, offload, quantized = zero_settings(zero)
    return not (hpz or offload or quantized or getattr(zero, "zenflow", None) is not None)


def zero_settings(zero):
    """``(hpZ, parameter offload, quantized weights)`` of upstream's ``zero_optimization`` config:
    the settings that keep host shards off."""
    offload = zero.offload_param is not None and zero.offload_param.device != "none"
    quantized = bool(zero.zero_quantized_weights or zero.zero_quantized_nontrainable_weights)
    return zero.zero_hpz_partition_size > 1, offload, quantized
