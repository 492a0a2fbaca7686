# SPDX-License-Identifier: Apache-2.0
"""How long a step's ZeRO collectives take on a described cluster: a deliberately simple model.

Each collective is a ring over the data-parallel ranks. A ring all-gather or reduce-scatter of a
tensor of ``S`` bytes cut into shares runs ``W - 1`` rounds; in each round every rank sends one
slice, and slices are padded to the largest share (uneven ZeRO shares gather and reduce padded
slices), so every rank sends ``(W - 1) * max_share * S`` bytes. An all-reduce is a reduce-scatter
then an all-gather. The ring's speed is its slowest link: the inter-host link when the ring spans
hosts (each host's boundary is crossed by one stream each way), else the slowest intra-host link.
Time = bytes / bandwidth + rounds * latency.

What each ZeRO stage runs per optimizer step (``P`` parameters of ``b`` bytes, ``gas`` micro-steps),
as DeepSpeed 0.19.8 runs it:
- 0: one all-reduce of the gradients;
- 1: one all-reduce of the gradients (``average_tensor`` all-reduces each gradient bucket over the
  data-parallel group while ``use_multi_rank_bucket_allreduce`` is on, upstream's default; each
  rank then keeps its own partition's slice; with it off, each owner's slice is reduced to its
  owner: a reduce-scatter's bytes), one all-gather of the updated parameters;
- 2: the same gradient reduction at every micro-step, one all-gather of the parameters;
- 3: at every micro-step an all-gather of the parameters in the forward, a reduce-scatter of the
  gradients, and in the backward an all-gather of the parameters the forward released: those
  beyond ``stage3_max_reuse_distance`` elements (upstream keeps a parameter gathered when it is used
  again within that many elements, so a model under it, 1e9 by default, is gathered once per
  micro-step; ``memory/peak.py`` counts the same).

The backend: ``gloo`` (CPU ranks) runs a reduce-scatter as an all-reduce of the whole tensor, each
rank then copying its chunk (torch's ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so
there it costs an all-reduce's bytes (measured: bench_zero3_link_bytes.py); ``nccl`` runs rings.

Not modelled (docs/planning.md, "Limits"): overlap of communication with compute (the prediction
adds them), the fork's hierarchical reduction and host shards (which cut inter-host bytes), NCCL's
tree algorithms, congestion, and links shared with other traffic.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Collective:
    name: str
    per_step: int
    """How many times a step runs it."""
    rounds: int
    bytes_per_rank: float
    """Bytes each rank sends per run."""
    seconds: float
    """Per step, all runs together."""

    def to_dict(self):
        return {"name": self.name, "per_step": self.per_step, "bytes_per_rank": int(self.bytes_per_rank),
                "seconds": self.seconds}


def slowest_link(cluster):
    """``(link, where)``: the link a ring over every rank of ``cluster`` runs at."""
    if len(cluster.host_names) > 1:
        return cluster.inter_host_link, "inter-host"
    return min(cluster.intra_host_links, key=lambda link: link.gbit_per_s), "intra-host"


UPSTREAM_MAX_REUSE_DISTANCE = 1_000_000_000
"""``zero_optimization.stage3_max_reuse_distance``'s default (elements)."""
BACKENDS = ("nccl", "gloo")


def zero_collectives(stage, num_parameters, value_bytes, world, gas, max_share, link, backend="nccl",
                     gradient_all_reduce=True, max_reuse_distance=UPSTREAM_MAX_REUSE_DISTANCE):
    """The collectives one optimizer step runs, with their time over ``link``.

    Args:
        stage: ZeRO stage 0-3.
        num_parameters: trainable parameters; value_bytes: bytes per gradient/parameter element.
        world: data-parallel ranks; gas: micro-steps per step.
        max_share: the largest rank's share of the partitioned state (1 / world when even).
        backend: "nccl" or "gloo" (a reduce-scatter costs an all-reduce there).
        gradient_all_reduce: ZeRO-1/2 ``use_multi_rank_bucket_allreduce`` (upstream's default: on).
        max_reuse_distance: ZeRO-3 ``stage3_max_reuse_distance`` (elements).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
    if world < 2:
        return []
    tensor = float(num_parameters) * value_bytes
    slice_bytes = max(float(max_share), 1.0 / world) * tensor
    one = (world - 1) * slice_bytes

    def run(name, per_step, rounds_factor=1, fraction=1.0):
        rounds = rounds_factor * (world - 1)
        sent = rounds_factor * one * fraction
        seconds = per_step * (sent / link.bytes_per_s + rounds * link.latency_us * 1e-6)
        return Collective(name, per_step, rounds, sent, seconds)

    def reduce_scatter(name, per_step):
        if backend == "gloo":
            return run(f"{name} (gloo: an all-reduce)", per_step, 2)
        return run(name, per_step)

    if stage == 0:
        return [run("all-reduce gradients", 1, 2)]
    if stage in (1, 2):
        reductions = 1 if stage == 1 else gas
        gradients = (run("all-reduce gradients", reductions, 2) if gradient_all_reduce else
                     run("reduce gradients to their owners", reductions))
        return [gradients, run("all-gather parameters", 1)]
    collectives = [run("all-gather parameters (forward)", gas)]
    released = max(0.0, 1.0 - float(max_reuse_distance) / float(num_parameters)) if num_parameters else 0.0
    if released > 0:
        collectives.append(run("all-gather parameters (backward, released ones)", gas, fraction=released))
    return collectives + [reduce_scatter("reduce-scatter gradients", gas)]


def collective_settings(cluster, ds_config, allocations=None):
    """The keyword arguments of ``zero_collectives`` for ``cluster`` under ``ds_config`` (a dict):
    gloo where every rank is a CPU rank, the ZeRO block's bucket all-reduce and reuse distance."""
    zero = ds_config.get("zero_optimization", {}) or {}
    reuse = getattr(allocations, "max_reuse_distance", None)
    if reuse is None:
        reuse = zero.get("stage3_max_reuse_distance", UPSTREAM_MAX_REUSE_DISTANCE)
    return {"backend": "gloo" if all(getattr(r, "cpu", False) for r in cluster.ranks) else "nccl",
            "gradient_all_reduce": bool(zero.get("use_multi_rank_bucket_allreduce", True)),
            "max_reuse_distance": int(reuse)}


def communication_seconds(collectives):
    return sum(c.seconds for c in collectives)


def bytes_over_link(collectives):
    """Bytes each rank sends per step (what crosses the slowest link per direction)."""
    return sum(c.bytes_per_rank * c.per_step for c in collectives)
