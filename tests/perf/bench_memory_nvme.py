# SPDX-License-Identifier: Apache-2.0
"""Per-rank NVMe offload under a physical memory limit: a ZeRO-3 rank whose
memory cannot hold its optimizer state puts it on NVMe, trains where upstream is killed, and its
memory cgroup shows the saving.

On the CPU accelerator offload to the host moves nothing out of a rank's process, so no memory
cgroup can see it; NVMe offload can: DeepSpeed's async-io op writes the swapped optimizer state to
files with O_DIRECT, past the page cache. This benchmark measures that.

Workload: 2 ranks, ZeRO-3, DeepSpeedCPUAdam (the client's), fp32, 8 x Linear(2048, 2048) (33.6M
parameters), sub-groups of 4M elements, ZeRO-3 buffers of 2-4M elements, global batch 8 split
[4, 4], one torch thread per rank.
Runs, each in two fresh processes, rank 1's peak read from its memory cgroup (counted from just
before ``deepspeed.initialize``, as in bench_memory.py):

1. ``device``: the fork on, no limit, no offload: every rank keeps its state.
2. ``nvme``: the fork on, rank 1's emulated memory below its state and its node's host budget
   (``cpu_memory_limit``) too small to take it: the pool puts all of rank 1's optimizer state on
   NVMe (``heterogeneous_offload.nvme_offload``); rank 0 keeps its own.
3. ``upstream, limited``: the fork off, rank 1 under a memory cgroup halfway between the peaks of
   1 and 2 (the limit is derived from this run's own measurements). Killed, or not.
4. ``nvme, limited``: run 2 with that physical limit (the fork's ``emulation.mode: cgroup``).

Reported: rank 1's peak in 1 and 2 and the reduction, and its cgroup's peak at the end of
``deepspeed.initialize`` and its usage after training (the peak is set during training, not at
start-up); what 3 and 4 did; samples/s of 2 against 1 (the price of the NVMe traffic, no target);
the parameters of 2 and 4 against 1 in units of one Adam step (lr). Needs root, the cgroup memory
controller and libaio (async-io op).

Measured on the 2-core CPU machine (2026-12-02, tests/perf/results/memory_nvme.json): rank 1's peak
1032 -> 896 MiB (-13%; -9% in a quick run), far less than the ~200 MiB of optimizer state moved:
upstream's NVMe path adds its own swap and gradient buffers, and the peak grows over the training
steps (446-470 MiB after initialize). At the limit halfway between the two peaks both upstream and
the fork were killed. Throughput 59% of the device run; parameters identical.

    python tests/perf/bench_memory_nvme.py [--quick]     (from the repository root)

Writes tests/perf/results/memory_nvme.json (not with ``--quick``).
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_memory import METER_BYTES, REPO, _median, _outcome, _peak_bytes, cgroups_unusable  # noqa: E402
from harness import run_ranks  # noqa: E402

WIDTH, LAYERS, LR = 2048, 8, 1e-3
MICRO_BATCHES = [4, 4]
GLOBAL_BATCH = sum(MICRO_BATCHES)
SUB_GROUP = 4_000_000
# ZeRO-3's buffers, the same in every run and small beside the model state (upstream's defaults,
# 5e8-element reduce buckets among them, would hold more than the optimizer state measured here).
BUFFERS = {"reduce_bucket_size": 2_000_000, "stage3_prefetch_bucket_size": 2_000_000,
           "stage3_max_live_parameters": 4_000_000, "stage3_max_reuse_distance": 4_000_000}
RESULTS = REPO / "tests" / "perf" / "results" / "memory_nvme.json"


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _current_bytes(path):
    v1 = path / "memory.usage_in_bytes"
    return int((v1 if v1.exists() else path / "memory.current").read_text())


def _config(mode, nvme_path, rank_1_gb):
    config = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP, **BUFFERS}}
    if mode == "upstream_limited":
        config["train_micro_batch_size_per_gpu"] = MICRO_BATCHES[0]
        return config
    heterogeneous = {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": MICRO_BATCHES}
    if mode != "device":
        heterogeneous["emulation"] = {"memory_gb": [4.0, rank_1_gb], "mode": "cgroup" if mode.endswith("limited")
                                      else "dilation"}
        config["zero_optimization"]["heterogeneous_offload"] = {"nvme_offload": True, "nvme_path": nvme_path}
    config["heterogeneous_config"] = heterogeneous
    config["heterogeneous_memory"] = {"enabled": True, "adaptive_chunking": False, "hbm_utilization_threshold": 1.0,
                                      "cpu_memory_limit": "1MB"}
    return config


def _train(rank, world_size, mode, nvme_path, rank_1_gb, limit_bytes, steps):
    import torch
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.heterogeneous.emulation import emulator as emulation

    torch.set_num_threads(1)
    model = _model()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(GLOBAL_BATCH, WIDTH, generator=generator) for _ in range(steps)]
    config = _config(mode, nvme_path, rank_1_gb)
    own = None
    if mode != "nvme_limited":
        limited = mode == "upstream_limited" and rank == 1
        own = emulation.MemoryLimitCgroup(limit_bytes if limited else METER_BYTES, label=f"nvme-rank{rank}")
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), optimizer=optimizer,
                                           config=config)
    runtime = engine._heterogeneous_runtime() if "heterogeneous_config" in config else None
    cgroup = own if own is not None else runtime.limits.memory_cgroup
    init_peak = _peak_bytes(cgroup.path)
    lo, times = sum(MICRO_BATCHES[:rank]), []
    for x in batches:
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x[lo:lo + MICRO_BATCHES[rank]]).pow(2).mean())
        engine.step()
        times.append(time.perf_counter() - start)
    peak = _peak_bytes(cgroup.path)
    current = _current_bytes(cgroup.path)
    state = getattr(engine._config, "heterogeneous", None)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    if own is not None:
        own.close()
    if runtime is not None:
        runtime.close()
    result = {"peak_bytes": peak, "current_bytes": current, "init_peak_bytes": init_peak, "step_s": times[1:],
              "nvme_ranks": list(getattr(state, "nvme_ranks", ())),
              "swap_optimizer": bool(getattr(engine.optimizer, "swap_optimizer", False))}
    if rank == 0:
        result["params"] = flat
    return result


def _run(mode, nvme_path, rank_1_gb=None, limit_bytes=None, steps=6):
    from deepspeed.runtime.heterogeneous.emulation.cgroups import remove_stale_cgroups_everywhere
    started = time.perf_counter()
    try:
        ranks, outcome = run_ranks(_train, world_size=2, timeout=900,
                                   args=(mode, nvme_path, rank_1_gb, limit_bytes, steps)), "trained"
    except AssertionError as failure:
        ranks, outcome = None, _outcome(failure)
    finally:
        remove_stale_cgroups_everywhere()
    print(f"[bench_memory_nvme] {mode}: {outcome} ({time.perf_counter() - started:.0f} s, "
          f"load {os.getloadavg()[0]:.2f})", flush=True)
    return {"outcome": outcome, "ranks": ranks}


def _summary(run, reference=None):
    if run["ranks"] is None:
        return {"outcome": run["outcome"]}
    first, second = run["ranks"]
    step = max(_median(first["step_s"]), _median(second["step_s"]))
    out = {"outcome": run["outcome"], "rank1_peak_mib": second["peak_bytes"] / 2**20,
           "rank1_initialize_peak_mib": second["init_peak_bytes"] / 2**20,
           "rank1_after_training_mib": second["current_bytes"] / 2**20,
           "rank0_peak_mib": first["peak_bytes"] / 2**20, "samples_per_s": GLOBAL_BATCH / step,
           "nvme_ranks": first["nvme_ranks"], "rank1_swaps": second["swap_optimizer"]}
    if reference is not None:
        out["max_diff_in_lr_steps"] = float((first["params"] - reference["ranks"][0]["params"]).abs().max()) / LR
    return out


def main(quick=False):
    problem = cgroups_unusable()
    if problem:
        sys.exit(f"bench_memory_nvme: {problem}")
    from deepspeed.ops.op_builder import AsyncIOBuilder
    if not AsyncIOBuilder().is_compatible(verbose=False):
        sys.exit("bench_memory_nvme: DeepSpeed's async-io op cannot build here: apt-get install libaio-dev")
    steps = 3 if quick else 6
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    # Rank 1's emulated memory: its parameters and gradients (fp32, half each) and a third of its
    # optimizer state: the pool must offload, and the 1 MB host budget sends it to NVMe.
    rank_1_gb = (8 * params / 2 + 12 * params / 2 / 3) / 2**30
    with tempfile.TemporaryDirectory(prefix="dsh-nvme-") as nvme_path:
        device = _run("device", nvme_path, steps=steps)
        nvme = _run("nvme", nvme_path, rank_1_gb, steps=steps)
        report = {"device": _summary(device), "nvme": _summary(nvme, device)}
        if device["ranks"] and nvme["ranks"]:
            high, low = device["ranks"][1]["peak_bytes"], nvme["ranks"][1]["peak_bytes"]
            report["rank1_peak_reduction"] = 1 - low / high
            report["nvme_throughput_vs_device"] = report["nvme"]["samples_per_s"] / report["device"]["samples_per_s"]
            limit = (high + low) // 2
            report["limit_mib"] = limit / 2**20
            upstream = _run("upstream_limited", nvme_path, limit_bytes=limit, steps=steps)
            report["upstream_limited"] = _summary(upstream)
            from deepspeed.runtime.heterogeneous.emulation.emulator import GIB, HOST_ALLOWANCE_BYTES
            limited = _run("nvme_limited", nvme_path, (limit - HOST_ALLOWANCE_BYTES) / GIB, steps=steps)
            report["nvme_limited"] = _summary(limited, device)
    print(json.dumps(report, indent=2))
    if not quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(report, indent=2) + "\n")
        print(f"[bench_memory_nvme] wrote {RESULTS.relative_to(REPO)}")
    return report


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 steps per run, no JSON")
    main(parser.parse_args().quick)
