# SPDX-License-Identifier: Apache-2.0
"""The memory pool's report (``HeterogeneousMemoryPool.report()``): per rank, where parameters,
gradients, optimizer state and activations live and the room left, as a table (``str()``) and as
plain data (``to_dict()``); per node, what is offloaded to the host against its budget."""

from dataclasses import dataclass, field
from typing import Optional

from ..measure.devices import BYTES_PER_GB

DEVICE = "device"


@dataclass(frozen=True)
class MemoryReport:
    pool: object = field(repr=False)
    """The ``HeterogeneousMemoryPool``: budgets, nodes, names."""
    placement: Optional[object]
    """Its last ``MemoryPlacement``, or None before ``place``."""

    def to_dict(self):
        pool, placement = self.pool, self.placement
        nodes = [{"node": host, "ranks": [r for r, h in enumerate(pool.hosts) if h == host],
                  "host_budget_bytes": pool.host_budget,
                  "offloaded_bytes": placement.host_bytes(host) if placement else 0.0}
                 for host in sorted(set(pool.hosts))]
        if placement is None:
            ranks = [{"rank": r, "node": pool.hosts[r], "device": pool.device_names[r], "capacity_bytes": c,
                      "budget_bytes": b} for r, (c, b) in enumerate(zip(pool.capacities, pool.budgets))]
            return {"placed": False, "utilization": pool.utilization, "ranks": ranks, "nodes": nodes}
        return {
            "placed": True, "zero_stage": placement.zero_stage, "utilization": pool.utilization,
            "partition_shares": None if placement.partition_shares is None else list(placement.partition_shares),
            "ranks": [_rank_dict(r) for r in placement.ranks], "nodes": nodes, "problems": list(placement.problems)}

    def __str__(self):
        pool, placement = self.pool, self.placement
        if placement is None:
            header = ("rank", "node", "device", "budget")
            rows = [(r, pool.hosts[r], pool.device_names[r], format_size(b)) for r, b in enumerate(pool.budgets)]
            return _table(header, rows) + "\nno model placed yet (HeterogeneousMemoryPool.place)"
        header = ("rank", "node", "device", "budget", "share", "parameters", "gradients", "optimizer state",
                  "activations", "buffers", "at start", "predicted peak", "measured peak", "room left")
        rows = [(r.rank, r.host, r.name, format_size(r.budget_bytes), f"{r.share:.3f}",
                 f"{format_size(r.parameter_bytes)} device",
                 f"{format_size(r.gradient_bytes)} device", _optimizer_cell(r),
                 "unmeasured" if r.activation_bytes is None else f"{format_size(r.activation_bytes)} device",
                 format_size(r.buffer_bytes), format_size(r.baseline_bytes),
                 "-" if r.predicted_peak_bytes is None else f"{format_size(r.predicted_peak_bytes)} ({r.peak_phase})",
                 "not yet" if r.measured_peak_bytes is None else _measured_cell(r),
                 _room_cell(r)) for r in placement.ranks]
        lines = [f"ZeRO stage {placement.zero_stage}, budgets {pool.utilization:.0%} of each device "
                 "(heterogeneous_memory.hbm_utilization_threshold)", _table(header, rows)]
        for node in self.to_dict()["nodes"]:
            limit = node["host_budget_bytes"]
            offloaded = format_size(node['offloaded_bytes'])
            lines.append(f"node {node['node']} (ranks {node['ranks']}): {offloaded} offloaded "
                         f"to the host of {'no limit' if limit is None else format_size(limit)} "
                         "(heterogeneous_memory.cpu_memory_limit)")
        lines += [f"problem: {p}" for p in placement.problems]
        return "\n".join(lines)


def _rank_dict(rank):
    on_device = rank.optimizer_bytes - rank.offloaded_bytes
    return {"rank": rank.rank, "node": rank.host, "device": rank.name, "capacity_bytes": rank.capacity_bytes,
            "budget_bytes": rank.budget_bytes, "share": rank.share,
            "parameters": {"bytes": rank.parameter_bytes, "location": DEVICE},
            "gradients": {"bytes": rank.gradient_bytes, "location": DEVICE},
            "optimizer_state": {"bytes": rank.optimizer_bytes, "location": rank.optimizer_location,
                                "device_bytes": on_device, "offloaded_bytes": rank.offloaded_bytes,
                                "offload_fraction": rank.offload_fraction},
            "activations": {"bytes": rank.activation_bytes, "location": DEVICE},
            "device_bytes": rank.device_bytes, "host_bytes": rank.host_bytes, "room_bytes": rank.room_bytes,
            "fits": rank.fits, "baseline_bytes": rank.baseline_bytes, "buffer_bytes": rank.buffer_bytes,
            "predicted_peak_bytes": rank.predicted_peak_bytes, "peak_phase": rank.peak_phase,
            "measured_peak_bytes": rank.measured_peak_bytes}


def _optimizer_cell(rank):
    if rank.offload_fraction <= 0:
        return f"{format_size(rank.optimizer_bytes)} device"
    if rank.offload_fraction >= 1:
        return f"{format_size(rank.optimizer_bytes)} {rank.optimizer_location}"
    return (f"{format_size(rank.optimizer_bytes - rank.offloaded_bytes)} device + {format_size(rank.offloaded_bytes)} "
            f"{rank.optimizer_location} ({rank.offload_fraction:.0%})")


def _measured_cell(rank):
    cell = format_size(rank.measured_peak_bytes)
    if rank.predicted_peak_bytes:
        cell += f" ({rank.measured_peak_bytes / rank.predicted_peak_bytes:.0%} of predicted)"
    return cell


def _room_cell(rank):
    if rank.room_bytes is None:
        return "no limit known"
    return format_size(rank.room_bytes) if rank.fits else f"-{format_size(-rank.room_bytes)} (over)"


def _table(header, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_size(size):
    """Bytes as GiB, MiB or bytes, three significant digits."""
    if size is None:
        return "-"
    if abs(size) >= BYTES_PER_GB / 10:
        return f"{size / BYTES_PER_GB:.3g} GiB"
    if abs(size) >= 2**20 / 10:
        return f"{size / 2**20:.3g} MiB"
    return f"{int(size)} B"
