# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_config.communication.link_aware_buckets``: ZeRO's gradient bucket size from the
slowest measured link between hosts (docs/multihost.md, "Link-aware buckets"). Pure: no processes.

Upstream gives every cluster the same bucket (``reduce_bucket_size`` and ``allgather_bucket_size``,
5e8 elements: 2 GB in fp32), whatever joins its hosts. A bucket is the unit the gradient
reduction sends and the unit it can overlap with the backward pass, so its right size depends on
how long it takes on the slowest link, which every bucket of a data-parallel reduction crosses:

- large enough that the fixed cost of one collective (about a millisecond for TCP between hosts,
  tens of microseconds for NCCL over InfiniBand, counting the three steps of the hierarchical
  reduction) stays a few percent of its transfer;
- small enough that the last bucket of a backward pass, which nothing overlaps, costs little, and
  that the fp32 bucket buffers do not hold memory for nothing. On a 200 Mbit/s link upstream's
  bucket would take 80 s: in practice the whole gradient goes as one bucket, after the backward.

The rule: a bucket takes ``TARGET_SECONDS`` (50 ms) on the slowest measured inter-host link,
``bandwidth * 0.05 / 4`` fp32 elements, at least ``MIN_ELEMENTS`` (adaptive chunking's floor),
never above upstream's default, in multiples of 1024 elements. 10 Gbit/s gives 1.6e7 elements, 100 Gbit/s 1.6e8, 400 Gbit/s
upstream's 5e8; links under ~670 Mbit/s reach the floor of 2^20.

The bandwidth is the probe's (``topology.discover_topology``), measured once as the config is
coordinated and broadcast from rank 0, so the size is identical on every rank, as anything that shapes a
collective must be. A size the user's config sets is kept; with ``heterogeneous_memory.
adaptive_chunking`` the smaller of the two sizes wins (both are upper bounds: one for memory, one
for the link). ZeRO-3's prefetch and live-parameter budgets are memory budgets and stay with
adaptive chunking. ZeRO-0 reduces in buckets of a fixed size that the config does not reach.
"""

ELEMENT_BYTES = 4
"""Buckets are counted in fp32 elements, as ZeRO's reduction buffers may be fp32."""

TARGET_SECONDS = 0.05
"""How long one bucket should take on the slowest link (see the module's docstring)."""

MIN_ELEMENTS = 1 << 20
"""No bucket below a million elements (4 MiB): under it per-collective costs dominate, whatever the link."""

ALIGN_ELEMENTS = 1024
"""Sizes are multiples of 1024 elements: ZeRO-1/2 assert that a bucket is a multiple of their
alignment factor (2 elements in fp16, more with other dtypes), which any power of two up to 1024 divides."""

BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000}
"""The zero_optimization keys the rule sets, with upstream's default (the ceiling)."""


def link_bucket_elements(bandwidth, target_seconds=TARGET_SECONDS, ceiling=500_000_000):
    """Elements of a bucket that takes ``target_seconds`` over a link of ``bandwidth`` bytes/s,
    clamped to [MIN_ELEMENTS, ceiling] and rounded down to a multiple of ``ALIGN_ELEMENTS``."""
    if not bandwidth or bandwidth <= 0:
        raise ValueError(f"link bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    elements = min(ceiling, max(MIN_ELEMENTS, bandwidth * target_seconds // ELEMENT_BYTES))
    return _aligned(elements)


def _aligned(elements):
    return max(ALIGN_ELEMENTS, int(elements) // ALIGN_ELEMENTS * ALIGN_ELEMENTS)


def link_buckets_decision(setting, enabled, topology):
    """Whether the link-aware bucket size applies, and a note saying why not (or None).

    Args:
        setting: ``communication.link_aware_buckets`` (True, False or "auto").
        enabled: ``heterogeneous_config.enabled``.
        topology: the run's ``Topology`` (None: one host, or the fork off)."""
    if not enabled or setting is False:
        return False, None
    if topology is None or topology.num_hosts == 1:
        return False, "the data-parallel ranks run on one host"
    if topology.link_bandwidth is None:
        return False, "no inter-host bandwidth was measured"
    return True, None


def keys_set_by_user(param_dict):
    """The keys of the config's ``zero_optimization`` block as the user wrote it; None for the
    legacy boolean form (``"zero_optimization": true``), which has no keys to add sizes to."""
    zero = param_dict.get("zero_optimization")
    if zero is None:
        return frozenset()
    return frozenset(zero) if isinstance(zero, dict) else None


def link_bucket_sizes(bandwidth, user_zero, chunk_sizes=None):
    """{key: elements} for each key of ``BUCKET_DEFAULTS`` the user's ``zero_optimization`` block
    does not set (``user_zero``: its keys as the user wrote them): the link's size, or adaptive
    chunking's (``chunk_sizes``) where that is smaller (aligned like the link's)."""
    sizes = {}
    for key, default in BUCKET_DEFAULTS.items():
        if key in user_zero:
            continue
        size = link_bucket_elements(bandwidth, ceiling=default)
        if chunk_sizes and key in chunk_sizes:
            size = _aligned(min(size, chunk_sizes[key]))
        sizes[key] = size
    return sizes


def apply_link_aware_buckets(param_dict, setting, enabled, topology, user_zero, chunk_sizes=None):
    """Write the link-aware bucket sizes into ``param_dict``'s ``zero_optimization`` block (a
    copy: the user's dict is not modified) before upstream parses it.

    ``user_zero`` is the keys of the block as the user wrote it (``keys_set_by_user``, before
    adaptive chunking added its sizes). Returns (sizes written, note): ({}, why not) when the rule
    does not apply."""
    active, note = link_buckets_decision(setting, enabled, topology)
    if active and user_zero is None:
        active, note = False, "zero_optimization is given in the legacy boolean form"
    if not active:
        return {}, note
    sizes = link_bucket_sizes(topology.link_bandwidth, user_zero, chunk_sizes)
    if sizes:
        zero = dict(param_dict.get("zero_optimization") or {})
        zero.update(sizes)
        param_dict["zero_optimization"] = zero
    return sizes, None


def describe_link_buckets(sizes, bandwidth):
    """One line for the log and the env report, e.g.
    ``reduce_bucket_size 1.6e+07, allgather_bucket_size 1.6e+07 elements (50 ms at 10000 Mbit/s)``."""
    shown = ", ".join(f"{key} {value:.2g}" for key, value in sizes.items())
    return f"{shown} elements ({TARGET_SECONDS * 1e3:.0f} ms at {bandwidth * 8 / 1e6:.0f} Mbit/s)"
