# SPDX-License-Identifier: Apache-2.0
"""How long a step's ZeRO collectives take on a described cluster: a deliberately simple model.

Each collective is a ring over the data-parallel ranks. A ring all-gather or reduce-scatter of a
tensor of ``S`` bytes cut into shares runs ``W - 1`` rounds; in each round every rank sends one
slice, and slices are padded to the largest share (uneven ZeRO shares gather and reduce padded
slices), so every rank sends ``(W - 1) * max_share * S`` bytes. An all-reduce is a reduce-scatter
then an all-gather. The ring's speed is its slowest link: the inter-host link when the ring spans
hosts (each host's boundary is crossed by one stream each way), else the slowest intra-host link.
Time = bytes / bandwidth + rounds * latency.

What each ZeRO stage runs per optimizer step (``P`` parameters of ``b`` bytes, ``gas`` micro-steps):
- 0: one all-reduce of the gradients;
- 1: one reduce-scatter of the gradients, one all-gather of the updated parameters;
- 2: a reduce-scatter of the gradients at every micro-step, one all-gather of the parameters;
- 3: at every micro-step an all-gather of the parameters in the forward, another in the backward,
  and a reduce-scatter of the gradients.

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


def zero_collectives(stage, num_parameters, value_bytes, world, gas, max_share, link):
    """The collectives one optimizer step runs, with their time over ``link``.

    Args:
        stage: ZeRO stage 0-3.
        num_parameters: trainable parameters; value_bytes: bytes per gradient/parameter element.
        world: data-parallel ranks; gas: micro-steps per step.
        max_share: the largest rank's share of the partitioned state (1 / world when even).
    """
    if world < 2:
        return []
    tensor = float(num_parameters) * value_bytes
    slice_bytes = max(float(max_share), 1.0 / world) * tensor
    one = (world - 1) * slice_bytes

    def run(name, per_step, rounds_factor=1):
        rounds = rounds_factor * (world - 1)
        seconds = per_step * (rounds_factor * one / link.bytes_per_s + rounds * link.latency_us * 1e-6)
        return Collective(name, per_step, rounds, rounds_factor * one, seconds)

    if stage == 0:
        return [run("all-reduce gradients", 1, 2)]
    if stage == 1:
        return [run("reduce-scatter gradients", 1), run("all-gather parameters", 1)]
    if stage == 2:
        return [run("reduce-scatter gradients", gas), run("all-gather parameters", 1)]
    return [run("all-gather parameters (forward)", gas), run("all-gather parameters (backward)", gas),
            run("reduce-scatter gradients", gas)]


def communication_seconds(collectives):
    return sum(c.seconds for c in collectives)


def bytes_over_link(collectives):
    """Bytes each rank sends per step (what crosses the slowest link per direction)."""
    return sum(c.bytes_per_rank * c.per_step for c in collectives)
