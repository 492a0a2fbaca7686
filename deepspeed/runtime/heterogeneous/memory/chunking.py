# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_memory.adaptive_chunking``: ZeRO's bucket and prefetch sizes from the smallest
rank's memory (docs/memory.md, "Adaptive chunking"). Pure: no processes.

Upstream sizes its communication buckets (``reduce_bucket_size``, ``allgather_bucket_size``) and
ZeRO-3's prefetch and live-parameter budgets (``stage3_prefetch_bucket_size``,
``stage3_max_live_parameters``) with one default for every device: 5e8 elements is 2 GB of fp32
bucket, a rounding error on an 80 GB device and a real share of a 16 GB one. With adaptive
chunking each size is a fixed fraction of the *smallest* rank's memory capacity, never above
upstream's default. The bucket sizes shape collectives, so they must be identical on every rank:
they come from the gathered devices, the same list on every rank. A size the config sets itself
is kept.
"""

ELEMENT_BYTES = 4
"""Budgets are counted in fp32 elements: reductions and ZeRO's flat buffers may run in fp32."""

# zero_optimization key -> (its alias in upstream's model, fraction of the smallest capacity, upstream default)
CHUNK_BUDGETS = {
    "reduce_bucket_size": (None, 0.02, 500_000_000),
    "allgather_bucket_size": (None, 0.02, 500_000_000),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", 0.01, 50_000_000),
    "stage3_max_live_parameters": ("max_live_parameters", 0.05, 1_000_000_000),
}

MIN_ELEMENTS = 1 << 20
"""No budget below a million elements: smaller buckets cost more in per-collective latency than
they save in memory."""

SIZE_ALIGNMENT = 1024
"""Every size is a multiple of this: ZeRO-1/2 refuse an ``allgather_bucket_size`` that is not a
multiple of their collective alignment (2 elements), and a round size costs nothing."""


def adaptive_chunk_sizes(capacities, zero_config):
    """The sizes adaptive chunking sets: {key: elements} for every key of ``CHUNK_BUDGETS`` that
    ``zero_config`` (the ds_config's ``zero_optimization`` dict) does not set itself.

    ``capacities``: each rank's memory capacity in bytes (None where unknown). Returns {} when no
    capacity is known (the CPU accelerator's ranks share host RAM: only an emulated capacity
    counts there)."""
    known = [c for c in capacities or () if c]
    if not known:
        return {}
    smallest = min(known)
    sizes = {}
    for key, (alias, fraction, default) in CHUNK_BUDGETS.items():
        if key in zero_config or (alias is not None and alias in zero_config):
            continue
        size = int(min(default, max(MIN_ELEMENTS, smallest * fraction // ELEMENT_BYTES)))
        sizes[key] = size if size == default else size - size % SIZE_ALIGNMENT
    return sizes


def apply_adaptive_chunking(param_dict, capacities):
    """Write the adaptive sizes into ``param_dict``'s ``zero_optimization`` block (a copy: the
    user's dict is not modified) before upstream parses it. Returns the sizes written."""
    zero = dict(param_dict.get("zero_optimization") or {})
    sizes = adaptive_chunk_sizes(capacities, zero)
    if sizes:
        zero.update(sizes)
        param_dict["zero_optimization"] = zero
    return sizes
