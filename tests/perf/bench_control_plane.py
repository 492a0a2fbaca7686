# SPDX-License-Identifier: Apache-2.0
"""The start-up control plane on N real gloo ranks: time, bytes and rounds against N.

Every rank starts ``deepspeed.initialize`` with the fork on (compute-aware plan, memory pool) on a
tiny model (one 16 x 16 linear layer, ZeRO-1), with hosts emulated by ``CROSS_RANK`` (``--per-host``
ranks each), then trains ``--steps`` steps with ``profile_steps`` 1, so that the first profiling
agreement and its plan broadcast run too. Each rank times the phases of its start-up (wrappers
around the fork's functions, installed in the rank before the engine is built):

- ``settings agreement`` (``cluster.agreement.check_settings_agree``: through the rendezvous store,
  not a collective: each rank sets its summary, rank 0 reads all of them and sets the verdict);
- ``device gather`` (``cluster.ranks.gather_local_devices``: one all-gather of each rank's device);
- ``topology probe`` (``cluster.topology.discover_topology``: one all-gather of host keys, the
  leaders' point-to-point probe, one broadcast of the bandwidths);
- ``start-up plan`` (``startup.initial_plan``: planned on every rank alike, no collective);
- ``memory placement`` (``startup.place_engine_state``, with ``memory baselines``,
  ``startup.gather_baselines``: one all-gather);
- ``process groups`` (``torch.distributed.new_group``: the hierarchical reduction's host groups);
- ``profiling gather`` and ``plan broadcast`` (``HeterogeneousRuntime._profiling_step``: one
  all-gather of the step's measurements, then rank 0's decision broadcast).

Every collective through ``deepspeed.comm`` is recorded by a ``comm_clock`` listener with its
phase and this rank's payload (pickled bytes for object collectives); the store calls of the
settings agreement are counted on a proxy of the store. From them, per phase: the rounds (the
collectives every rank issues, and the leader's point-to-point messages) and the bytes a rank
receives (an all-gather of objects pads every entry to the largest and sends the sizes first:
``N * (max + 8)``; a broadcast: the source's payload), fitted as ``a + b * N`` and extrapolated to
1,024 and 10,000 ranks.

    OMP_NUM_THREADS=1 python tests/perf/bench_control_plane.py [--ranks 2 4 8 16 32] [--per-host 4]

(from the repository root; 32 ranks take some 12 GB of memory and a few minutes on 2 cores; the
times are of N processes sharing this machine's cores, so they grow with N for that reason too:
the bytes and rounds are what carries to a real cluster). Writes
``tests/perf/results/control_plane.json``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import _run_group  # noqa: E402

RESULTS = REPO / "tests" / "perf" / "results" / "control_plane.json"
PHASES = ("settings agreement", "device gather", "topology probe", "start-up plan", "memory placement",
          "memory baselines", "process groups", "profiling gather", "plan broadcast")
EXTRAPOLATE = (1024, 10000)


# -- in each rank ---------------------------------------------------------------------------------


def _start(rank, world_size, per_host, steps):
    os.environ["CROSS_RANK"] = str(rank // per_host)  # the emulated host (topology.host_key)
    import pickle
    import inspect
    import torch
    import torch.distributed as torch_dist
    import deepspeed
    from deepspeed.runtime.heterogeneous import startup
    from deepspeed.runtime.heterogeneous.cluster import agreement, ranks, topology
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    from deepspeed.runtime.heterogeneous.runtime import HeterogeneousRuntime

    torch.set_num_threads(1)
    stack, seconds, records, calls, store_calls = ["other"], {}, [], {}, {}

    def timed(owner, name, phase):
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            stack.append(phase)
            calls[phase] = calls.get(phase, 0) + 1
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - began
                stack.pop()

        setattr(owner, name, wrapper)

    timed(agreement, "check_settings_agree", "settings agreement")
    timed(ranks, "gather_local_devices", "device gather")
    timed(topology, "discover_topology", "topology probe")
    timed(startup, "initial_plan", "start-up plan")
    timed(startup, "gather_baselines", "memory baselines")
    timed(startup, "place_engine_state", "memory placement")
    from torch.distributed import distributed_c10d
    timed(distributed_c10d, "new_group", "process groups")  # new_subgroups_by_enumeration calls it there
    torch_dist.new_group = distributed_c10d.new_group
    timed(HeterogeneousRuntime, "_profiling_step", "profiling")

    class CountingStore:
        """The rendezvous store as the fork's agreements use it, counting calls and bytes per phase
        (the settings agreement; every agreement's check-in)."""

        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            attribute = getattr(self._store, name)
            if name not in ("set", "get", "wait", "check", "multi_get"):
                return attribute

            def call(*args):
                count = store_calls.setdefault(stack[-1], {"ops": 0, "bytes": 0})
                count["ops"] += 1
                if name == "set":
                    count["bytes"] += len(args[1])
                result = attribute(*args)
                if name == "get":
                    count["bytes"] += len(result)
                elif name == "multi_get":
                    count["bytes"] += sum(len(value) for value in result)
                return result

            return call

    real_store = agreement._store
    agreement._store = lambda: (lambda store: None if store is None else CountingStore(store))(real_store())

    signatures = {}

    def listen(func, args, kwargs):
        signature = signatures.get(func) or signatures.setdefault(func, inspect.signature(func))
        bound = signature.bind(*args, **kwargs)
        arguments = bound.arguments
        name = func.__name__
        if name == "all_gather_object":
            payload = len(pickle.dumps(arguments["obj"]))
        elif name == "broadcast_object_list":
            objects = arguments["object_list"]
            payload = sum(len(pickle.dumps(o)) for o in objects) if objects and objects[0] is not None else 0
        else:
            payload = sum(value.numel() * value.element_size() for value in arguments.values()
                          if isinstance(value, torch.Tensor))
        phase = stack[-1]
        if phase == "profiling":
            phase = "plan broadcast" if name == "broadcast_object_list" else "profiling gather"
        records.append((phase, name, payload))

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    batch = 2 * world_size
    config = {"train_batch_size": batch, "gradient_clipping": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 1},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 1},
              "heterogeneous_memory": {"enabled": True}}
    # What the memory meter imports at its start on the host (memory.meter.load_engine_modules: torch's
    # first optimizer step imports torch._dynamo anyway), here, so that its seconds stay out of the phases.
    from deepspeed.runtime.heterogeneous.memory.meter import load_engine_modules
    load_engine_modules()
    torch_dist.barrier()  # imports done everywhere: what follows is the start-up alone
    comm_clock.set_listener(listen)
    began = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    initialized = time.perf_counter()
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        size = engine.train_micro_batch_size_per_gpu()
        for _ in range(engine.gradient_accumulation_steps()):
            inputs = torch.randn(size, 16, generator=generator)
            loss = engine(inputs).pow(2).mean()
            engine.backward(loss)
            engine.step()
    trained = time.perf_counter()
    comm_clock.set_listener(None)
    topology_found = engine.heterogeneous_state.topology
    micro_batch = engine.train_micro_batch_size_per_gpu()
    engine.destroy()
    return {"rank": rank, "initialize_s": initialized - began, "steps_s": trained - initialized, "phases_s": seconds,
            "calls": calls, "collectives": records, "store": store_calls, "micro_batch": micro_batch,
            "hosts": None if topology_found is None else topology_found.num_hosts}


# -- the parent -----------------------------------------------------------------------------------


def summarize(world, results):
    """Per phase: seconds (the slowest rank), rounds (collectives per rank; the busiest rank's
    point-to-point messages) and the bytes a rank receives (see the module docstring)."""
    phases = {}
    for phase in PHASES:
        per_rank = [[(op, size) for p, op, size in r["collectives"] if p == phase] for r in results]
        collective = [op for op, _ in per_rank[0] if op not in ("send", "recv", "isend", "irecv")]
        received = 0
        for index, op in enumerate(collective):
            sizes = [[s for o, s in ops if o not in ("send", "recv", "isend", "irecv")][index] for ops in per_rank]
            if op in ("all_gather_object", "all_gather", "all_gather_into_tensor"):
                received += world * (max(sizes) + (8 if op == "all_gather_object" else 0))
            elif op == "broadcast_object_list":
                received += max(sizes) + 8
            else:
                received += max(sizes)
        point_to_point = max(sum(1 for op, _ in ops if op in ("send", "recv", "isend", "irecv")) for ops in per_rank)
        p2p_bytes = max(sum(s for op, s in ops if op in ("send", "recv", "isend", "irecv")) for ops in per_rank)
        times = [r["phases_s"].get(phase if phase not in ("profiling gather", "plan broadcast") else "profiling")
                 for r in results]
        known = [t for t in times if t is not None]
        timed_as = phase if phase not in ("profiling gather", "plan broadcast") else "profiling"
        store = [r["store"].get(timed_as, {"ops": 0, "bytes": 0}) for r in results]
        phases[phase] = {"seconds": max(known) if known else None, "rounds": len(collective),
                         "ops": sorted(set(collective)), "bytes_received_per_rank": received,
                         "point_to_point_messages": point_to_point, "point_to_point_bytes": p2p_bytes,
                         "calls": results[0]["calls"].get(timed_as, 0),
                         "store_calls_rank0": store[0]["ops"], "store_bytes_rank0": store[0]["bytes"],
                         "store_calls_other": max((s["ops"] for s in store[1:]), default=0),
                         "store_calls_served": sum(s["ops"] for s in store)}
    return {"ranks": world, "initialize_s": max(r["initialize_s"] for r in results),
            "steps_s": max(r["steps_s"] for r in results), "phases": phases,
            "micro_batches": [r["micro_batch"] for r in results], "hosts": results[0]["hosts"]}


def fit_line(points):
    """Least squares ``y = a + b * x``; returns (a, b)."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x)**2 for x, _ in points)
    slope = 0.0 if spread == 0 else sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope


def quadratic_term(points):
    """The ``c`` of a least-squares ``a + b x + c x^2`` (three or more x), to show it is ~0."""
    import numpy
    xs = numpy.array([x for x, _ in points], dtype=float)
    ys = numpy.array([y for _, y in points], dtype=float)
    if len(set(xs)) < 3:
        return 0.0
    return float(numpy.polyfit(xs, ys, 2)[0])


def growth(rows):
    """Per phase and quantity, the fit against N, its formula and the extrapolations."""
    fits = {}
    for phase in PHASES:
        entry = {}
        for quantity in ("bytes_received_per_rank", "rounds", "point_to_point_messages", "store_calls_rank0",
                         "store_calls_served", "calls", "seconds"):
            points = [(row["ranks"], row["phases"][phase][quantity]) for row in rows
                      if row["phases"][phase][quantity] is not None]
            if not points:
                continue
            a, b = fit_line(points)
            entry[quantity] = {"a": a, "b": b, "c_quadratic": quadratic_term(points),
                               "formula": f"{a:.4g} + {b:.4g} * N",
                               **{f"at_{n}": a + b * n for n in EXTRAPOLATE}}
        fits[phase] = entry
    return fits


def run_group(world, per_host, steps):
    """Every rank's result (``harness.run_ranks``'s group), and the ranks that reported theirs but then
    did not exit within the harness's grace (killed: N processes on a few cores may take longer to tear
    their process groups down; what they reported stands)."""
    outcome = _run_group(_start, (per_host, steps), world, max(600, 30 * world), {"OMP_NUM_THREADS": "1"})
    problems = [p for p in outcome.problems() if "did not exit" not in p]
    if problems or len(outcome.final) != world:
        raise AssertionError(f"{world}-rank group failed:\n" + "\n".join(problems))
    if outcome.stuck_at_exit:
        print(f"note: ranks {outcome.stuck_at_exit} reported, then did not exit within the grace (killed)", flush=True)
    return [outcome.final[rank][1] for rank in range(world)], list(outcome.stuck_at_exit)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--per-host", type=int, default=4, help="ranks per emulated host (CROSS_RANK)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    rows, began = [], time.perf_counter()
    load = os.getloadavg()
    for world in args.ranks:
        started = time.perf_counter()
        results, stuck = run_group(world, args.per_host, args.steps)
        row = summarize(world, results)
        row["stuck_at_exit"] = stuck
        row["elapsed_s"] = time.perf_counter() - started
        row["load_average"] = os.getloadavg()
        rows.append(row)
        phases = row["phases"]
        shown = "; ".join(f"{name} {phases[name]['seconds'] * 1000:.0f} ms ({phases[name]['rounds']} collectives, "
                          f"{phases[name]['bytes_received_per_rank']} B in per rank, "
                          f"{phases[name]['store_calls_rank0']} store calls on rank 0)"
                          for name in PHASES if phases[name]["seconds"] is not None)
        print(f"[{time.perf_counter() - began:.0f} s] N={world}: deepspeed.initialize {row['initialize_s']:.2f} s "
              f"(the slowest rank), {row['hosts']} host(s); {shown}; the group took {row['elapsed_s']:.0f} s, "
              f"load {row['load_average'][0]:.1f}", flush=True)
    fits = growth(rows)
    for phase, entry in fits.items():
        quantities = "; ".join(f"{q} = {f['formula']} (1,024: {f['at_1024']:.4g}, 10,000: {f['at_10000']:.4g})"
                               for q, f in entry.items() if q != "seconds" and (f["a"] or f["b"]))
        print(f"{phase}: {quantities}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"per_host": args.per_host, "steps": args.steps, "load_average_at_start": load,
                                   "cpus": os.cpu_count(), "rows": rows, "growth": fits}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
