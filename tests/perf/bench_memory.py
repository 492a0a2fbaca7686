# SPDX-License-Identifier: Apache-2.0
"""Each rank carries the ZeRO state its memory allows: a rank under a physical memory limit trains
where even slices die, with a lower peak, at nearly the speed memory would otherwise allow.

Workload: 2 ranks, ZeRO-2 (``--stage 1``: ZeRO-1), Adam (torch's), fp32, a parameter-heavy MLP
(12 x Linear(2048, 2048): 50M parameters, 200 MB), global batch 8 split [4, 4], one torch thread
per rank. Parameter-heavy so that the optimizer step is a real part of the step (target
>= 20%): a layout that gives rank 0 more of the state gives it more of the optimizer's work, and
the throughput figure must see that cost. Two fractions are printed: ``engine.step()`` (DeepSpeed's
optimizer step: gradient norm, Adam, copy-back, all-gather of the updated parameters; the target)
and Adam's update of the rank's slice alone (the part the shares move between the ranks). Rank 1 gets a memory cgroup of
``MEMORY_GB[stage][1]`` GiB plus the fork's 256 MiB host allowance (``emulation.memory_gb``, mode
"cgroup"); rank 0 has room.

Runs, each in two fresh processes (memory one run freed and the allocator kept would otherwise
be reused, uncounted, by the next):

- ``upstream, limited``: the fork off; the benchmark puts rank 1 under the same limit itself (as
  tests/unit/heterogeneous/test_memory_limits.py does). Killed by the kernel, or not.
- ``fork even, limited``: ``zero_partitions: "even"``: refused by the fork's memory check, killed,
  or trains.
- ``fork shares, limited``: ``heterogeneous_memory.enabled``, ``zero_partitions: "auto"``: the
  shares follow each rank's memory (the memory pool's placement; no engine applies per-rank
  offload yet, so every rank's state is in its own memory, and the pool's plan is recorded).
- ``upstream, no limit`` (even slices) and ``fork shares, no limit`` (the shares the limited run
  chose, given as a list): the references. Rank 1's peak with the shares against its peak with
  even slices, at the same global batch, is the saving (target >= 38%).
- side by side, no limit: one engine with even slices and one with the shares in the same two
  processes, trained in alternating blocks (ABBA). Throughput of the shares against the ideal of
  the fitting configuration, even slices without a memory limit (what this cluster trains at when
  memory is not a constraint, even optimizer work): target >= 85%. Separate runs on a machine
  other jobs share differ by more than the effect (the separate runs' samples/s are printed too);
  blocks side by side see the same load. Here the ranks share two cores and one memory bus, and a
  rank idle in a collective lends them to the busy one, which hides the uneven Adam work; an
  estimate for ranks on devices of their own (even slices' step with its Adam update scaled to
  the largest share) is printed beside it.

Peak memory is the rank's memory cgroup's max usage (v1 ``memory.max_usage_in_bytes``, v2
``memory.peak``), counted from the engine's start: the fork joins its cgroup in
``deepspeed.initialize``, and in the other runs the benchmark joins one (the limit, or a 64 GiB
meter that never limits) just before calling it. The interpreter, torch and the model as first
built are left out; the parameters are counted all the same, since ZeRO copies them into flat
buffers inside the cgroup. The cgroup is left before the parameters are sent back.

Throughput of a run: the median wall time of its timed steps (ranks aligned at a barrier before
each), after warm-up steps. Exactness: every run that trains ends with the parameters of
``upstream, no limit``; the largest difference in units of one Adam step (lr), target <= 1e-5
(fp32). The load average before and after is recorded: re-run when it is high.

Targets are reported, not asserted. Needs root and the cgroup memory controller.

    python tests/perf/bench_memory.py [--quick] [--stage 1|2]     (from the repository root)

``--quick`` (a smoke test, < 90 s on an idle 2-core machine): three runs (upstream limited, fork
shares limited, upstream without limit), fewer steps, the saving from the limited run's peak,
throughput from separate runs, no JSON. The full run writes tests/perf/results/memory.json
(ZeRO-2) or memory_zero1.json.
"""

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_ranks  # noqa: E402

WIDTH, LAYERS, LR = 2048, 12, 1e-3
MICRO_BATCHES = [4, 4]
GLOBAL_BATCH = sum(MICRO_BATCHES)
# Rank 1's emulated memory per ZeRO stage: its cgroup limit (+ 256 MiB) must sit between rank 1's
# peak with even slices (ZeRO-2 ~930-990 MiB, ZeRO-1 ~980-1100) and what the fork predicts it needs
# with a small share at the default threshold (memory_peak: the flat parameters, 200 MB, and the
# buffers count). ZeRO-2's 0.6 GiB is test_memory_limits.py's; ZeRO-1's 0.75 GiB is not checked
# against the predicted peak (ZeRO-1 also holds every gradient, 200 MB, whatever its share).
MEMORY_GB = {2: [4.0, 0.6], 1: [4.0, 0.75]}
# heterogeneous_memory.hbm_utilization_threshold: the default; the fork plans with its predicted
# peak (memory_peak: buffers and what is in use at the start included), so no room is held back.
UTILIZATION = {2: 0.85, 1: 0.85}
BUCKET = 2_000_000  # reduce bucket (elements), the same in every run (as test_memory_limits.py)
METER_BYTES = 64 * 2**30  # a memory cgroup that only measures
WARMUP = {"full": 2, "quick": 1}
TIMED = {"full": 5, "quick": 2}
SIDE_ROUNDS, SIDE_BLOCK = 4, 2  # side-by-side throughput: blocks per configuration, steps per block
TARGET_REDUCTION = 0.38
TARGET_THROUGHPUT = 0.85
TARGET_EXACT_STEPS = 1e-5  # largest parameter difference, in Adam steps (lr)
TARGET_OPTIMIZER_FRACTION = 0.20
RESULTS = REPO / "tests" / "perf" / "results" / "memory.json"


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def _batches(count):
    import torch
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(GLOBAL_BATCH, WIDTH, generator=generator) for _ in range(count)]


def _config(mode, stage, shares):
    config = {"train_batch_size": GLOBAL_BATCH, "steps_per_print": 10**6,
              "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET}}
    if mode.startswith("upstream"):
        config["train_micro_batch_size_per_gpu"] = MICRO_BATCHES[0]
        return config
    heterogeneous = {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": MICRO_BATCHES}
    partitions = {"fork_even_limited": "even", "fork_auto_limited": "auto", "fork_shares": shares}[mode]
    if mode.endswith("limited"):
        heterogeneous["emulation"] = {"memory_gb": MEMORY_GB[stage], "mode": "cgroup"}
    config["heterogeneous_config"] = heterogeneous
    config["heterogeneous_memory"] = {"enabled": True, "adaptive_chunking": False,
                                      "hbm_utilization_threshold": UTILIZATION[stage], "zero_partitions": partitions}
    return config


def _peak_bytes(path):
    v1 = path / "memory.max_usage_in_bytes"
    return int((v1 if v1.exists() else path / "memory.peak").read_text())


def _state_bytes(optimizer):
    """Bytes of this rank's slice of the ZeRO state, from the tensors themselves: ``(fp32 master
    slice, Adam's moments)``. ZeRO-2's gradient slice has the master slice's size."""
    master = sum(p.numel() * p.element_size() for p in optimizer.single_partition_of_fp32_groups)
    moments = sum(t.numel() * t.element_size() for state in optimizer.optimizer.state.values()
                  for t in state.values() if hasattr(t, "numel") and t.dim() > 0)
    return master, moments


def _steps(engine, rank, batches):
    """Train on ``batches`` (this rank's rows of each); per step: wall seconds (ranks aligned at a
    barrier first), seconds in ``engine.step()`` (the optimizer step and the parameter all-gather)
    and seconds in the torch Adam's own step (this rank's slice)."""
    from deepspeed import comm as dist
    adam = engine.optimizer.optimizer
    adam_step, adam_times = adam.step, []

    def timed_adam_step(*args, **kwargs):
        start = time.perf_counter()
        result = adam_step(*args, **kwargs)
        adam_times.append(time.perf_counter() - start)
        return result

    adam.step = timed_adam_step  # instrumentation only: the same step, timed
    lo = sum(MICRO_BATCHES[:rank])
    steps, engine_steps = [], []
    for x in batches:
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(x[lo:lo + MICRO_BATCHES[rank]]).pow(2).mean())
        before_step = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        steps.append(end - start)
        engine_steps.append(end - before_step)
    adam.step = adam_step
    return steps, engine_steps, adam_times


def _train(rank, world_size, mode, stage, shares, warmup, timed):
    """One run; returns this rank's peak, layout, state bytes and step times (rank 0 also the
    parameters)."""
    import torch
    import deepspeed
    from deepspeed.runtime.heterogeneous.emulation import emulator as emulation

    torch.set_num_threads(1)
    model = _model()
    batches = _batches(warmup + timed)
    config = _config(mode, stage, shares)
    own_cgroup = None
    if mode.startswith("upstream") or mode == "fork_shares":
        limited = mode == "upstream_limited"
        own_cgroup = emulation.MemoryLimitCgroup(
            emulation.memory_limit_bytes(MEMORY_GB[stage][rank]) if limited else METER_BYTES, label=f"rank{rank}")
    started = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    initialize_s = time.perf_counter() - started
    runtime = engine._heterogeneous_runtime() if "heterogeneous_config" in config else None
    cgroup = own_cgroup if own_cgroup is not None else runtime.limits.memory_cgroup

    steps, engine_steps, adam_steps = _steps(engine, rank, batches)
    peak = _peak_bytes(cgroup.path)
    limit = cgroup.limit_bytes if mode.endswith("limited") else None
    master, moments = _state_bytes(engine.optimizer)
    result = {"peak_bytes": peak, "limit_bytes": limit, "shares": engine._config.heterogeneous.partition_shares,
              "partition_elements": sum(int(p.numel()) for p in engine.optimizer.single_partition_of_fp32_groups),
              "master_bytes": master, "moments_bytes": moments,
              "gradient_slice_bytes": master if stage == 2 else 0,  # ZeRO-2 keeps the gradients of its slice
              "planned_location": _planned_location(engine, rank), "initialize_s": initialize_s,
              "step_s": steps[warmup:], "engine_step_s": engine_steps[warmup:], "adam_step_s": adam_steps[warmup:]}
    # Training is over: leave the cgroup before sending 200 MB of parameters to the parent.
    if own_cgroup is not None:
        own_cgroup.close()
    if runtime is not None:
        runtime.close()
    flat = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    result["param_checksum"] = float(flat.double().sum())
    if rank == 0:
        result["params"] = flat.clone()
    return result


def _planned_location(engine, rank):
    """Where the fork's memory pool placed this rank's optimizer state ('device', 'host', 'nvme'),
    or None when no pool decided (the fork off, or heterogeneous_memory not enabled)."""
    state = getattr(engine._config, "heterogeneous", None)
    placement = getattr(getattr(state, "memory_pool", None), "placement", None)
    if placement is None:
        return None
    mine = placement.ranks[rank]
    return mine.optimizer_location if mine.offload_fraction > 0 else "device"


def _side_by_side(rank, world_size, stage, shares, rounds, block):
    """Throughput of even slices and of ``shares`` in the same processes, no memory limit: two
    engines of the same model, trained in alternating blocks of ``block`` steps (ABBA, so neither
    gains from its place in the order), ``rounds`` blocks each. Separate runs on a machine shared
    with other jobs differ by more than the effect measured; blocks side by side see the same load."""
    import torch
    import deepspeed

    torch.set_num_threads(1)
    engines = {}
    for label, partitions in (("even", "even"), ("shares", shares)):
        model = _model()
        config = _config("fork_shares", stage, partitions)
        engines[label], _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batches = _batches(1)
    times = {label: {"step_s": [], "engine_step_s": [], "adam_step_s": []} for label in engines}
    for label, engine in engines.items():
        _steps(engine, rank, batches)  # warm-up
    order = ("even", "shares")
    for round_index in range(rounds):
        for label in order if round_index % 2 == 0 else order[::-1]:
            measured = _steps(engines[label], rank, batches * block)
            for key, values in zip(("step_s", "engine_step_s", "adam_step_s"), measured):
                times[label][key] += values
    for engine in engines.values():
        engine._heterogeneous_runtime().close()
    return times


def _outcome(failure):
    """'killed' or 'refused: <the error>' from run_ranks' failure message."""
    text = str(failure)
    for line in text.splitlines():
        if "exited with code -9" in line:
            return f"killed ({line.split(' without')[0]}, SIGKILL from the kernel)"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    raised = next((i for i, line in enumerate(lines) if line.startswith("rank ") and line.endswith("raised:")), None)
    if raised is not None:
        block = lines[raised + 1:]
        end = next((i for i, line in enumerate(block) if line.startswith("rank ")), len(block))
        return f"refused ({lines[raised][:-len(' raised:')]}): {block[:end][-1]}"
    return "failed: " + " ".join(lines[:3])


def _median(values):
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _run(mode, stage, shares, quick):
    """One run's per-rank results, or its outcome when a rank was killed or refused."""
    from deepspeed.runtime.heterogeneous.emulation.cgroups import remove_stale_cgroups_everywhere
    label = "quick" if quick else "full"
    started = time.perf_counter()
    try:
        ranks = run_ranks(_train, world_size=2, timeout=600, args=(mode, stage, shares, WARMUP[label], TIMED[label]))
        outcome = "trained"
    except AssertionError as failure:
        ranks, outcome = None, _outcome(failure)
    finally:
        remove_stale_cgroups_everywhere()  # a killed rank's cgroup stays until the next start
    seconds, load = time.perf_counter() - started, os.getloadavg()
    print(f"[bench_memory] {mode}: {outcome} ({seconds:.0f} s, load {load[0]:.2f})", flush=True)
    return {"outcome": outcome, "ranks": ranks, "seconds": seconds, "loadavg_after": load}


def _run_side_by_side(stage, shares):
    """Median step time of even slices and of ``shares``, side by side (``_side_by_side``)."""
    started = time.perf_counter()
    ranks = run_ranks(_side_by_side, world_size=2, timeout=900, args=(stage, shares, SIDE_ROUNDS, SIDE_BLOCK))
    result = {}
    for label in ("even", "shares"):
        step = max(_median(r[label]["step_s"]) for r in ranks)  # the step ends together: the slower rank
        result[label] = {"median_step_s": step, "samples_per_s": GLOBAL_BATCH / step,
                         "adam_fraction": max(_median(r[label]["adam_step_s"]) / _median(r[label]["step_s"])
                                                   for r in ranks),
                         "optimizer_step_fraction": max(_median(r[label]["engine_step_s"]) / _median(r[label]["step_s"])
                                                     for r in ranks),
                         "adam_step_s_per_rank": [_median(r[label]["adam_step_s"]) for r in ranks]}
    result["seconds"], result["loadavg_after"] = time.perf_counter() - started, os.getloadavg()
    print(f"[bench_memory] side by side: even {result['even']['median_step_s']:.3f} s, shares "
          f"{result['shares']['median_step_s']:.3f} s per step ({result['seconds']:.0f} s, "
          f"load {result['loadavg_after'][0]:.2f})", flush=True)
    return result


def _summary(run):
    """The JSON row of a run that trained (parameters left out)."""
    if run["ranks"] is None:
        return {"outcome": run["outcome"], "seconds": run["seconds"], "loadavg_after": run["loadavg_after"]}
    per_rank = []
    for rank, r in enumerate(run["ranks"]):
        step = _median(r["step_s"])
        per_rank.append({
            "peak_mib": r["peak_bytes"] / 2**20,
            "limit_mib": None if r["limit_bytes"] is None else r["limit_bytes"] / 2**20,
            "share": None if r["shares"] is None else r["shares"][rank], "partition_elements": r["partition_elements"],
            "state_bytes": {"fp32_master": r["master_bytes"], "adam_moments": r["moments_bytes"],
                            "gradient_slice": r["gradient_slice_bytes"]},
            # No engine applies per-rank offload yet: the state is in the rank's own memory whatever
            # the pool planned; the pool's decision is shown beside it.
            "state_location": "device", "pool_placement": r["planned_location"],
            "initialize_s": r["initialize_s"], "median_step_s": step, "samples_per_s": MICRO_BATCHES[rank] / step,
            "adam_fraction": _median(r["adam_step_s"]) / step,
            "optimizer_step_fraction": _median(r["engine_step_s"]) / step})
    step = max(rank["median_step_s"] for rank in per_rank)
    return {"outcome": run["outcome"], "seconds": run["seconds"], "loadavg_after": run["loadavg_after"],
            "shares": run["ranks"][0]["shares"], "samples_per_s": GLOBAL_BATCH / step,
            "ranks_agree": run["ranks"][0]["param_checksum"] == run["ranks"][1]["param_checksum"], "per_rank": per_rank}


def cgroups_unusable():
    """Why this machine cannot put a rank under a memory cgroup, or None when it can."""
    from deepspeed.runtime.heterogeneous.emulation.cgroups import find_hierarchy, placement
    hierarchy = find_hierarchy("memory")
    if os.geteuid() != 0:
        return "not root"
    if hierarchy is None:
        return "no memory controller mounted"
    return None if os.access(placement(hierarchy), os.W_OK) else f"{placement(hierarchy)} is not writable"


def run(quick=False, stage=2):
    from deepspeed.runtime.heterogeneous.emulation.cgroups import remove_stale_cgroups_everywhere
    reason = cgroups_unusable()
    if reason is not None:  # `make perf` runs every benchmark: say why, and go on to the next
        print(f"bench_memory: skipped, memory cgroups are unusable here ({reason}); the benchmark needs root "
              "and the cgroup memory controller")
        return None
    remove_stale_cgroups_everywhere()
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs = {}
    runs["upstream_limited"] = _run("upstream_limited", stage, None, quick)
    if not quick:
        runs["fork_even_limited"] = _run("fork_even_limited", stage, None, quick)
    runs["fork_auto_limited"] = _run("fork_auto_limited", stage, None, quick)
    runs["upstream"] = _run("upstream", stage, None, quick)
    auto = runs["fork_auto_limited"]
    shares = list(auto["ranks"][0]["shares"]) if auto["ranks"] is not None and auto["ranks"][0]["shares"] else None
    side_by_side = None
    if shares is not None and not quick:
        runs["fork_shares"] = _run("fork_shares", stage, shares, quick)
        side_by_side = _run_side_by_side(stage, shares)
    load_after = os.getloadavg()

    rows = {mode: _summary(result) for mode, result in runs.items()}
    trained = {mode: result for mode, result in runs.items() if result["ranks"] is not None}
    report = {
        "workload": f"MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), {sum(WIDTH * WIDTH + WIDTH for _ in range(LAYERS))} "
                    f"parameters, ZeRO-{stage}, Adam (torch), fp32, 1 thread per rank",
        "stage": stage, "micro_batches": MICRO_BATCHES, "global_batch": GLOBAL_BATCH, "memory_gb": MEMORY_GB[stage],
        "hbm_utilization_threshold": UTILIZATION[stage], "quick": quick,
        "timed_steps": TIMED["quick" if quick else "full"], "warmup_steps": WARMUP["quick" if quick else "full"],
        "peak": "memory cgroup max usage from the engine's start (interpreter, torch and the model as first built "
                "left out)",
        "ideal": "even slices, no memory limit: what the cluster trains at when memory is not a constraint",
        "loadavg_before": load_before, "loadavg_after": load_after, "runs": rows}

    even = rows.get("upstream", {})
    # The fork's shares without the limit; --quick has only the limited run (the limit leaves the
    # peak below it, so that peak is the same quantity unless the kernel had to reclaim).
    fork = rows.get("fork_shares", rows.get("fork_auto_limited", {}))
    if "per_rank" in even and "per_rank" in fork:
        report["rank1_peak_reduction"] = 1.0 - fork["per_rank"][1]["peak_mib"] / even["per_rank"][1]["peak_mib"]
        report["rank1_peak_reduction_from"] = "fork_shares" if "fork_shares" in rows else "fork_auto_limited"
    if "per_rank" in even and "per_rank" in rows["fork_auto_limited"]:
        report["throughput_separate_runs"] = rows["fork_auto_limited"]["samples_per_s"] / even["samples_per_s"]
        report["optimizer_step_fraction"] = max(r["optimizer_step_fraction"] for r in even["per_rank"])
        report["adam_fraction"] = max(r["adam_fraction"] for r in even["per_rank"])
    if side_by_side is not None:
        report["side_by_side"] = side_by_side
        report["optimizer_step_fraction"] = side_by_side["even"]["optimizer_step_fraction"]
        report["adam_fraction"] = side_by_side["even"]["adam_fraction"]
        report["throughput_vs_ideal"] = side_by_side["shares"]["samples_per_s"] / side_by_side["even"]["samples_per_s"]
        report["throughput_measured"] = "side by side (same processes, alternating blocks)"
        # On this machine the ranks share two cores and one memory bus: a rank idle in a collective
        # lends both to the busy one, so the larger slice's Adam update costs less than its size
        # (measured: rank 0's update of 0.9 of the state takes about as long as each rank's update
        # of half of it with even slices). Devices of their own would not share: the estimate
        # scales even slices' Adam time with the largest share (Adam is linear in its slice) and
        # keeps the rest of the even step.
        even_adam = sum(side_by_side["even"]["adam_step_s_per_rank"]) / len(shares)
        slowest = max(shares) * len(shares)  # the largest slice against an even one
        even_step = side_by_side["even"]["median_step_s"]
        report["throughput_vs_ideal_own_devices_estimate"] = even_step / (even_step + even_adam * (slowest - 1))
    elif "throughput_separate_runs" in report:
        report["throughput_vs_ideal"] = report["throughput_separate_runs"]
        report["throughput_measured"] = "separate runs (--quick)"
    if "upstream" in trained and len(trained) > 1:
        base = trained["upstream"]["ranks"][0]["params"]
        report["max_param_difference_in_adam_steps"] = {
            mode: float((result["ranks"][0]["params"] - base).abs().max()) / LR
            for mode, result in trained.items() if mode != "upstream"}
    report["targets"] = _targets(report)
    report["elapsed_s"] = time.perf_counter() - started
    print_table(report)
    if not quick:
        name = RESULTS if stage == 2 else RESULTS.with_name(f"memory_zero{stage}.json")
        name.parent.mkdir(parents=True, exist_ok=True)
        name.write_text(json.dumps(report, indent=2))
        print(f"JSON written to {name.relative_to(REPO)}")
    return report


def _targets(report):
    runs = report["runs"]
    differences = report.get("max_param_difference_in_adam_steps", {})
    targets = {
        "upstream killed under the limit": runs["upstream_limited"]["outcome"].startswith("killed"),
        "fork with shares trains under the limit": runs["fork_auto_limited"]["outcome"] == "trained",
        f"rank 1's peak >= {TARGET_REDUCTION:.0%} below even slices":
            report.get("rank1_peak_reduction", -1.0) >= TARGET_REDUCTION,
        f"throughput >= {TARGET_THROUGHPUT:.0%} of the ideal":
            report.get("throughput_vs_ideal", 0.0) >= TARGET_THROUGHPUT,
        f"parameters equal (<= {TARGET_EXACT_STEPS:g} of an Adam step; every run's ranks alike)":
            bool(differences) and max(differences.values()) <= TARGET_EXACT_STEPS and
            all(row["ranks_agree"] for row in runs.values() if "per_rank" in row),
        f"optimizer step >= {TARGET_OPTIMIZER_FRACTION:.0%} of the step (workload check)":
            report.get("optimizer_step_fraction", 0.0) >= TARGET_OPTIMIZER_FRACTION,
    }
    if "fork_even_limited" in runs:
        refused = runs["fork_even_limited"]["outcome"] != "trained"
        targets["fork with even slices does not train under the limit"] = refused
    return targets


LABELS = {"upstream_limited": "upstream, limited", "fork_even_limited": "fork even, limited",
          "fork_auto_limited": "fork shares, limited", "upstream": "upstream, no limit (ideal)",
          "fork_shares": "fork shares, no limit"}


def print_table(report):
    limits = report["memory_gb"]
    print(f"\nheterogeneous memory: {report['workload']}, global batch {report['global_batch']} "
          f"{report['micro_batches']}; rank 1 limited to {limits[1]} GiB + 256 MiB (rank 0: {limits[0]} GiB + "
          f"256 MiB), {report['elapsed_s']:.0f} s, load average {report['loadavg_before'][0]:.2f} -> "
          f"{report['loadavg_after'][0]:.2f}")
    print(f"{'run':>27}  {'rank':>4}  {'share':>6}  {'state MiB':>9}  {'peak MiB':>8}  {'limit MiB':>9}  "
          f"{'samples/s':>9}  {'opt':>4}  {'adam':>4}  outcome")
    for mode, row in report["runs"].items():
        if "per_rank" not in row:
            print(f"{LABELS[mode]:>27}  {'':>4}  {'':>6}  {'':>9}  {'':>8}  {'':>9}  {'':>9}  {'':>4}  {'':>4}  "
                  f"{row['outcome']}")
            continue
        for rank, r in enumerate(row["per_rank"]):
            share = "1/2" if r["share"] is None else f"{r['share']:.3f}"
            limit = "-" if r["limit_mib"] is None else f"{r['limit_mib']:.0f}"
            state = sum(r["state_bytes"].values()) / 2**20
            print(f"{LABELS[mode] if rank == 0 else '':>27}  {rank:>4}  {share:>6}  {state:>9.0f}  "
                  f"{r['peak_mib']:>8.0f}  {limit:>9}  {r['samples_per_s']:>9.2f}  "
                  f"{r['optimizer_step_fraction']:>4.0%}  {r['adam_fraction']:>4.0%}  "
                  f"{row['outcome'] if rank == 0 else ''}")
    print("state: this rank's fp32 master slice + Adam moments (+ its gradient slice in ZeRO-2), all in the rank's "
          "own memory (no offload); peak: memory cgroup max usage from the engine's start; samples/s: the rank's "
          "micro-batch over its median step; opt: engine.step() (gradient norm, Adam, copy-back, all-gather of "
          "the updated parameters) over the whole step; adam: Adam's update of the rank's slice alone")
    if "rank1_peak_reduction" in report:
        print(f"rank 1's peak, {LABELS[report['rank1_peak_reduction_from']]} vs upstream, no limit (same global "
              f"batch): {report['rank1_peak_reduction']:.1%} lower")
    if "side_by_side" in report:
        even, shares = report["side_by_side"]["even"], report["side_by_side"]["shares"]
        print(f"side by side, no limit (same processes, alternating blocks): even slices {even['samples_per_s']:.2f} "
              f"samples/s, fork shares {shares['samples_per_s']:.2f} samples/s; of an even step, engine.step() is "
              f"{even['optimizer_step_fraction']:.0%} and Adam's update {even['adam_fraction']:.0%} (Adam per rank, "
              "s: even "
              f"{even['adam_step_s_per_rank'][0]:.3f}/{even['adam_step_s_per_rank'][1]:.3f}, shares "
              f"{shares['adam_step_s_per_rank'][0]:.3f}/{shares['adam_step_s_per_rank'][1]:.3f})")
    if "throughput_separate_runs" in report:
        print(f"throughput, fork shares under the limit vs upstream without it, separate runs: "
              f"{report['throughput_separate_runs']:.1%}")
    if "throughput_vs_ideal_own_devices_estimate" in report:
        print(f"estimate for ranks on devices of their own (even step, Adam's update scaled to the largest share): "
              f"{report['throughput_vs_ideal_own_devices_estimate']:.1%}")
    if "throughput_vs_ideal" in report:
        print(f"throughput vs the ideal (even slices, no limit), {report['throughput_measured']}: "
              f"{report['throughput_vs_ideal']:.1%}")
    for mode, difference in report.get("max_param_difference_in_adam_steps", {}).items():
        print(f"parameters, {LABELS[mode]} vs upstream, no limit: largest difference {difference:.3g} Adam steps")
    for name, met in report["targets"].items():
        print(f"target {name}: {'met' if met else 'NOT MET'}")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps, no 'fork even' run, no JSON (a smoke test)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage (default 2)")
    arguments = parser.parse_args()
    os.chdir(REPO)
    run(arguments.quick, arguments.stage)
