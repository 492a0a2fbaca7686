# SPDX-License-Identifier: Apache-2.0
"""What of ``heterogeneous_config.communication`` is in force, in words: the env report's
``Communication Optimization`` line and the one after it. Pure: no processes.

The feature has four parts, decided where they act: the hierarchical reduction
(``hierarchical.reduction_decision``, when the engine is built), link-aware buckets
(``link_buckets.link_buckets_decision``, as the config is coordinated), and the inter-host compression and
ZeRO-1/2/3's overlap (``overlap.overlap_decision``, which also needs the optimizer) and ZeRO-3's host
shards (``host_shard_plan.host_shards_decision``, which also need the model), which ride on the
hierarchical reduction. All of them need the ranks to span more than one host, which
only a running job knows (``topology.discover_topology``). A report made from a config alone, on
one host, therefore says what ``auto`` (or ``true``) would switch on across hosts, and calls the
feature Active only for a topology of several hosts where a part is in force.
"""

from .host_groups import reduction_decision
from .link_buckets import describe_link_buckets, link_bucket_sizes, link_buckets_decision
from .lossless import scope as lossless_scope
from .low_communication_plan import OuterSettings

ACROSS_HOSTS = "on when the data-parallel ranks span more than one host"


def _zero_stage(param_dict):
    zero = (param_dict or {}).get("zero_optimization")
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def communication_status(settings, topology=None, param_dict=None, link_sizes=None):
    """(active, parts): whether any part is in force and one phrase per part.

    Args:
        settings: the parsed ``HeterogeneousSettings``.
        topology: the run's ``Topology`` (None: not known, e.g. a report from a config).
        param_dict: the ds_config (its ZeRO stage decides what the reduction covers; its own
            bucket sizes are kept by the link-aware rule).
        link_sizes: the sizes the run chose (``state.link_bucket_sizes``); None: derived here from
            the topology and ``param_dict``."""
    config = settings.config.communication
    enabled = settings.enabled
    if not enabled:
        return False, ["off (heterogeneous_config.enabled is false)"]
    parts = []
    known = topology is not None
    hosts = tuple(topology.hosts) if known else None
    if config.mode == "low_communication":
        outer = OuterSettings.from_config(config.low_communication).describe()
        where = "" if not known or topology.num_hosts > 1 else " (refused: every rank runs on one host)"
        return True, [f"low-communication training, not exact: each host trains a replica, synchronised {outer}"
                      f"{where}; gradients reduced inside each host, upstream's buckets"]

    reduction = config.hierarchical_reduction
    if reduction is False:
        parts.append("hierarchical reduction off")
        reducing = False
    elif not known:
        parts.append(f"hierarchical reduction {_setting(reduction)}: {ACROSS_HOSTS}")
        reducing = False
    else:
        try:
            reducing, why = reduction_decision(reduction, True, hosts, True)
        except ValueError as exc:
            reducing, why = False, str(exc)
        if reducing and _zero_stage(param_dict) == 3:
            gathers = ("parameter gathers stay flat" if config.zero3_host_shards is False else
                       "parameter gathers inside each host, from host shards, where they apply")
            parts.append(f"hierarchical reduction on (ZeRO-3: the gradient reduce-scatter; {gathers})")
        else:
            parts.append("hierarchical reduction on" if reducing else f"hierarchical reduction off ({why})")

    buckets = config.link_aware_buckets
    if buckets is False:
        parts.append("link-aware buckets off")
        sizing = False
    elif not known:
        parts.append(f"link-aware buckets {_setting(buckets)}: {ACROSS_HOSTS}, sized from the measured link")
        sizing = False
    else:
        sizing, why = link_buckets_decision(buckets, True, topology)
        if sizing:
            zero = (param_dict or {}).get("zero_optimization")
            sizes = link_sizes if link_sizes is not None else link_bucket_sizes(
                topology.link_bandwidth, frozenset(zero) if isinstance(zero, dict) else ())
            sizing = bool(sizes)
            parts.append(f"link-aware buckets {describe_link_buckets(sizes, topology.link_bandwidth)}" if sizes else
                         "link-aware buckets off (the config sets every bucket size)")
        else:
            parts.append(f"link-aware buckets off ({why})")

    compression = config.compress_inter_host
    if compression:
        zero = (param_dict or {}).get("zero_optimization")
        reduce_scatter = zero.get("reduce_scatter", True) if isinstance(zero, dict) else True
        what = (lossless_scope(_zero_stage(param_dict), reduce_scatter) if compression == "lossless" else
                f"inter-host step compressed to {compression}")
        parts.append(what if reducing else f"{what}: with the hierarchical reduction")
    if reducing and _zero_stage(param_dict) > 0:
        parts.append("gradient buckets reduced during the backward where they can be captured" if config.overlap
                     is not False else "overlap off")
    return reducing or sizing, parts


def _setting(value):
    return "auto" if value == "auto" else "true"


def status_line(settings, topology=None, param_dict=None, link_sizes=None):
    """``Active (...)`` / ``Inactive (...)``: the state and its parts on one line, for the log."""
    active, parts = communication_status(settings, topology, param_dict, link_sizes)
    return f"{'Active' if active else 'Inactive'} ({'; '.join(parts)})"


def reduction_line(reducer, engine, communication, shards, shards_note, overlap_note, deferred_gather):
    """Rank 0's start-up line of the hierarchical reduction in force (``session.CommunicationSession``),
    with the lines of why ``"auto"`` left host shards or overlap off. Printed like the plan
    (``runtime.log_plan``): a default run shows WARNING and above only."""
    layout = reducer.layout
    stage = engine.zero_optimization_stage()
    compress = communication.compress_inter_host
    coding = ("" if not compress else f", {lossless_scope(stage, engine._config.zero_config.reduce_scatter)}"
              if reducer.lossless else f", inter-host step in {compress}")
    scheme = ("ZeRO-3: gradient chunks to their owners' hosts only" if stage == 3 else
              "ZeRO-1/2: owned slices and partitions between host leaders" if stage else
              "sharded" if layout.even else "through host leaders")
    lines = [f"[deepspeed-hetero] hierarchical gradient reduction over {layout.num_hosts} hosts "
             f"{[list(m) for m in layout.host_members]} ({scheme}{coding}"
             f"{', overlapped with the backward' if reducer.background is not None else ''}"
             f"{', parameters gathered during the next forward' if deferred_gather else ''}"
             f"{', parameters gathered inside each host' if shards is not None else ''})"]
    if shards_note and communication.zero3_host_shards == "auto" and stage == 3:
        lines.append("[deepspeed-hetero] ZeRO-3 parameters gathered over every rank, not inside each host: "
                     f"{shards_note}")
    if overlap_note and communication.overlap == "auto" and stage:
        lines.append(f"[deepspeed-hetero] gradient buckets reduced after each other, not overlapped: {overlap_note}")
    return "\n".join(lines)
