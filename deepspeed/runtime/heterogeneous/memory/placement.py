# SPDX-License-Identifier: Apache-2.0
"""The placement decision the memory pool's (``pool.py``) two users share: the engine's as it starts
(``startup.place_engine_state``, then ``startup.apply_rank_offload`` for the ranks it offloads) and
the env report's for a ds_config (``cli/env_report.config_placement_lines``,
``parse_parameter_count`` for ``--model-parameters``). Both decide through ``engine_placement``, so
the report shows what the engine would do."""

from .rank_placement import NVME
from .spec import zero3_offload_ratio


def refuse_unfit_peaks(pool, placement, offload_allowed):
    """Stop every rank, before DeepSpeed allocates, when a rank's predicted peak (``peak.py``,
    activations not yet counted) passes its budget whatever the pool chose: the profiling steps
    would find no plan either, and under a physical limit the rank would be killed. Every rank
    holds the same placement, so every rank raises the same error."""
    from .rank_placement import MemoryPlacementError
    unfit = [r for r in placement.ranks if r.predicted_peak_bytes is not None and not r.fits]
    if unfit:
        problems = [pool.rank_problem(r, pool.model_state, offload_allowed) for r in unfit]
        raise MemoryPlacementError("deepspeed-hetero memory pool: no placement fits: " + "; ".join(problems))


def engine_placement(pool, spec, zero_partitions, cpu_offload, nvme_offload=False, baseline_bytes=None,
                     activation_bytes=None):
    """``(placement, {offloading rank: (device, offload_optimizer.ratio)})``: the pool's placement of
    ``spec`` as an engine applies it.

    Per-rank offload drives ZeRO stages 1-3 on 2+ ranks to the host (``cpu_offload``) and ZeRO-3 to
    NVMe (``nvme_offload``; upstream's ZeRO-1/2 have no NVMe offload), only when the config does not
    offload every rank already. ZeRO-3 offloads whole sub-groups to the host
    (``ModelStateSpec.sub_groups``; all of them where the optimizer cannot be DeepSpeedCPUAdam), all
    of its optimizer state to NVMe. Once a ZeRO-1/2 rank offloads, the shares are even: upstream's
    offloaded ZeRO-1/2 path keeps equal slices (``partitions.zero_partition_layout``), so explicit
    uneven shares are refused."""
    applies = offloads_per_rank(spec.zero_stage, pool.world_size) and spec.optimizer_device is None
    per_rank = cpu_offload and applies
    nvme = nvme_offload and applies and spec.zero_stage == 3
    placement = pool.place(spec, zero_partitions=zero_partitions, cpu_offload=per_rank, nvme_offload=nvme,
                           strict=False, baseline_bytes=baseline_bytes, activation_bytes=activation_bytes)
    offloaded = tuple(placement.offloaded_ranks) if per_rank or nvme else ()
    if spec.zero_stage == 3:
        return placement, {rank: _zero3_offload(placement.ranks[rank], spec) for rank in offloaded}
    if offloaded and zero_partitions not in ("auto", "even"):
        raise ValueError(f"heterogeneous_memory.zero_partitions {list(zero_partitions)} gives the ranks uneven "
                         f"shares, but data-parallel rank(s) {list(offloaded)} must offload their optimizer state "
                         "to fit (zero_optimization.heterogeneous_offload.cpu_offload), and upstream's offloaded "
                         "ZeRO-1/2 path keeps equal slices. Use zero_partitions \"auto\" (shares from memory, even "
                         "once a rank offloads) or \"even\", or turn cpu_offload off")
    if offloaded and placement.partition_shares is not None:
        placement = pool.place(spec, zero_partitions="even", cpu_offload=True, nvme_offload=False, strict=False,
                               baseline_bytes=baseline_bytes, activation_bytes=activation_bytes)
        offloaded = tuple(placement.offloaded_ranks)
    return placement, {rank: ("cpu", 1.0) for rank in offloaded}


def _zero3_offload(rank, spec):
    """``(device, offload_optimizer.ratio)`` for what the pool chose for a ZeRO-3 rank: NVMe takes
    all of it; the host its number of sub-groups where known, else the fraction itself (upstream
    rounds it to sub-groups, keeping ``int((1 - ratio) * n)`` of them on the device)."""
    if rank.optimizer_location == NVME:
        return "nvme", 1.0
    if rank.offload_fraction >= 1.0 or rank.offload_sub_groups is None:
        return "cpu", min(1.0, rank.offload_fraction)
    return "cpu", zero3_offload_ratio(rank.offload_sub_groups, len(spec.sub_groups))


def offloads_per_rank(stage, world):
    """Where per-rank offload is applied: ZeRO stages 1-3 on 2+ data-parallel ranks."""
    return stage in (1, 2, 3) and world >= 2
