# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous pipeline stages against upstream's ``parameters`` partition, on one emulated cluster.

A ``PipelineModule`` of 12 residual MLP blocks (width 256, hidden 1024), 8 micro-batches of 16
samples per step, one replica (data-parallel size 1), SGD. Every stage is one CPU process with one
thread. For each emulated cluster it runs, in one invocation and one process group:

- ``parameters``: upstream's partition (equal parameters per stage, so equal blocks);
- ``heterogeneous``: ``partition_method="heterogeneous"``: blocks in proportion to stage speed.

Clusters: 2 stages at speeds [1.0, 0.5] and 3 stages at [1.0, 0.5, 0.5], each by time dilation and
by CPU-quota cgroups (where the machine allows them; skipped otherwise).

Each partition runs ``--rounds`` times, alternating, and the mean counts. It prints samples/s,
the ratio heterogeneous / parameters, the layers per stage, and the ratio of
each to the balanced pipeline's bound: ``sum(stage speeds) / t`` samples/s, ``t`` one sample's
forward and backward through all blocks on one unthrottled thread (the median of 10 timings, before
and after the runs, averaged), times ``m / (m + S - 1)`` for the bubble of m micro-batches through S stages. Results go
to ``tests/perf/results/pipeline.json``. Targets (reported, not asserted): >= 1.3x over
``parameters`` at [1.0, 0.5], and >= 90% of the bound.

A second bound is measured in the same process group: the same pipeline with every stage at full
speed (upstream's partition, equal stages), whose samples/s times ``sum(speeds) / S`` is what the
emulated cluster would reach with the same overheads and bubble if its stages were balanced
("eq. bound"; not with more stages than cores, where full-speed stages share the cores). It also
prints, per stage, the share of its wall time spent waiting in transfers and collectives
(where the comm clock runs: the dilated stages).

Last, the bytes each rank sends per step (from the recorded collectives, as ring collectives move
them): the 2-stage heterogeneous pipeline against ZeRO-3 data parallelism of the same blocks on the
same 2 ranks, which on a 2-host cluster (one rank per host) is what crosses the link. And, first,
the same two on an emulated 2-host cluster (``scripts/emulated_cluster.py``: one rank per network
namespace, a ``--link-mbit`` ``tbf``-shaped link; needs root, ``ip`` and ``tc``): samples/s and the
bytes the link carried per step, read from its ``tc`` counters.

    python tests/perf/bench_pipeline.py [--steps N] [--rounds R] [--modes dilation,cgroup] [--stages 2,3]
        [--link-mbit 200 --link-steps 3]
    (repository root, about 4 min)
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_subcases  # noqa: E402
from deepspeed.runtime.heterogeneous.planning.stages import balanced_bound  # noqa: E402

WIDTH, HIDDEN, BLOCKS, MICRO, MICRO_BATCHES, WARMUP = 256, 1024, 12, 16, 8, 2
CLUSTERS = {2: [1.0, 0.5], 3: [1.0, 0.5, 0.5]}
RESULTS = REPO / "tests" / "perf" / "results" / "pipeline.json"
TARGET_GAIN, TARGET_BOUND = 1.3, 0.90


def _blocks():
    import torch

    class Block(torch.nn.Module):

        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(WIDTH)
            self.up = torch.nn.Linear(WIDTH, HIDDEN)
            self.down = torch.nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    return [Block() for _ in range(BLOCKS)]


def _dataset(size):
    import torch
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(size, WIDTH, generator=generator),
                                          torch.randn(size, WIDTH, generator=generator))


def _run(rank, world_size, partition, speeds, mode, steps):
    import deepspeed
    import torch
    from deepspeed import comm as dist
    from deepspeed.pipe import PipelineModule

    net = PipelineModule(layers=_blocks(), num_stages=world_size, loss_fn=torch.nn.MSELoss(),
                         partition_method=partition)
    batch = MICRO * MICRO_BATCHES
    config = {"train_batch_size": batch, "gradient_accumulation_steps": MICRO_BATCHES, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "heterogeneous_config": {"enabled": True, "profile_steps": 0,
                                       "emulation": {"speeds": list(speeds), "mode": mode}}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                           training_data=_dataset(batch * (steps + WARMUP + 1)))
    from deepspeed.runtime.heterogeneous.measure import comm_clock
    for _ in range(WARMUP):
        engine.train_batch()
    dist.barrier()
    start = time.perf_counter()
    waited, slept = comm_clock.seconds_in_collectives(), comm_clock.seconds_dilated
    for _ in range(steps):
        engine.train_batch()
    dist.barrier()
    seconds = time.perf_counter() - start
    waited, slept = comm_clock.seconds_in_collectives() - waited, comm_clock.seconds_dilated - slept
    # Per stage: of the wall time, the share spent waiting in transfers and collectives, and the
    # share dilation slept (where the comm clock ran).
    shares = [None] * world_size
    dist.all_gather_object(shares, {"waiting": waited / seconds, "dilation": slept / seconds})
    return {"samples_per_s": batch * steps / seconds, "parts": [int(p) for p in net.parts], "stages": shares}


def _full_speed_sample_seconds(repeats=10):
    """One sample's forward and backward through all blocks on one thread at full speed: the
    median of ``repeats`` timings of a step's micro-batches."""
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*_blocks())
    inputs, targets = _dataset(MICRO).tensors
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(MICRO_BATCHES):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / (MICRO * MICRO_BATCHES)


DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}


def _flat(tensors):
    """(shape, dtype) pairs of a recorded entry's tensor arguments, a list argument flattened."""
    for _, value in tensors:
        if len(value) == 2 and isinstance(value[1], str):
            yield value
        else:
            yield from value


def _bytes(shape, dtype):
    count = 1
    for dim in shape:
        count *= dim
    return count * DTYPE_BYTES.get(dtype, 4)


def sent_bytes(entry, rank):
    """The bytes ``rank`` puts on its link for one recorded collective, as a ring implementation
    moves them: all-reduce 2 (n - 1) / n of the tensor, all-gather and reduce-scatter (n - 1) / n of
    the whole gathered or scattered tensor, a broadcast or a send its tensor from the sender.
    Receives, barriers and object collectives (a few bytes of pickles) count 0."""
    n = len(entry.group)
    if n < 2:
        return 0.0
    single = [_bytes(*t) for _, value in entry.tensors if len(value) == 2 and isinstance(value[1], str)
              for t in [value]]
    listed = [sum(_bytes(*t) for t in value) for _, value in entry.tensors
              if not (len(value) == 2 and isinstance(value[1], str))]
    total = max(single + listed + [0])
    op = entry.op
    if op in ("send", "isend"):
        return float(total)
    if op == "broadcast":
        return float(total) if dict(entry.details).get("src") == rank else 0.0
    if "all_reduce" in op:
        return 2.0 * (n - 1) / n * total
    if op.startswith(("all_gather", "allgather", "reduce_scatter")):
        return (n - 1) / n * total
    return 0.0


def two_rank_step(kind, steps):
    """On 2 ranks, rank 1 at half speed: the 2-stage heterogeneous pipeline (``kind="pipeline"``)
    or ZeRO-3 data parallelism of the same blocks (``"zero3"``); returns a function that trains one
    step and returns its mean loss, and the pipeline's cut (None for ZeRO-3). Data for ``steps``
    steps and a warm-up."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    batch = MICRO * MICRO_BATCHES
    config = {"train_batch_size": batch, "gradient_accumulation_steps": MICRO_BATCHES, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
              "heterogeneous_config": {"enabled": True, "profile_steps": 0,
                                       "emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}}}
    data = _dataset(batch * (steps + 2))
    if kind == "pipeline":
        net = PipelineModule(layers=_blocks(), num_stages=2, loss_fn=torch.nn.MSELoss(),
                             partition_method="heterogeneous")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                               training_data=data)
        return (lambda: float(engine.train_batch())), [int(p) for p in net.parts]
    config["zero_optimization"] = {"stage": 3}
    model = torch.nn.Sequential(*_blocks())
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data)
    batches = iter(loader)

    def step():
        total = 0.0
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = next(batches)
            loss = torch.nn.functional.mse_loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            total += float(loss)
        return total / engine.gradient_accumulation_steps()

    return step, None


def _bytes_run(rank, world_size, kind, steps):
    """Bytes each rank sends per step: the 2-stage heterogeneous pipeline, or ZeRO-3 data
    parallelism of the same blocks on the same 2 ranks (one per host on a 2-host cluster)."""
    from deepspeed.runtime.heterogeneous.measure.collective_log import recording

    step, _ = two_rank_step(kind, steps)
    step()  # warm-up: the pipeline's first step also exchanges the activations' shapes
    with recording() as entries:
        for _ in range(steps):
            step()
    return sum(sent_bytes(entry, rank) for entry in entries) / steps


LINK_TRAIN = REPO / "tests" / "perf" / "pipeline_link_train.py"


def link_run(rate_mbit, steps):
    """Samples/s and the link's bytes per step on an emulated 2-host cluster (one rank per host, a
    ``rate_mbit`` link, rank 1 at half speed): the 2-stage heterogeneous pipeline and ZeRO-3 data
    parallelism of the same blocks (``pipeline_link_train.py``). Bytes: host 0's ``tc`` counters,
    both directions, between the marks around the timed steps. None where the machine cannot
    emulate hosts (root, ``ip`` and ``tc``)."""
    import tempfile
    import threading

    sys.path.insert(0, str(REPO / "scripts"))
    import emulated_cluster as ec
    import harness

    reason = ec.available()
    if reason is not None:
        print(f"link run skipped: {reason}")
        return None
    rows = {}
    for kind in ("pipeline", "zero3"):
        marks = {}
        specs = [ec.HostSpec(ranks=1, rate_mbit=rate_mbit), ec.HostSpec(ranks=1, rate_mbit=rate_mbit)]
        with tempfile.TemporaryDirectory(prefix="bench_pipeline_link_") as folder, ec.EmulatedCluster(specs) as cluster:
            out = Path(folder)
            holder = {}
            launcher = threading.Thread(target=lambda: holder.update(run=cluster.launch_deepspeed(
                LINK_TRAIN, ["--kind", kind, "--steps", steps, "--out", out],
                env={**harness.fork_environment(), "OMP_NUM_THREADS": "1"}, timeout=1200,
                master_port=harness.free_port(), cwd=REPO)), daemon=True)
            launcher.start()
            while launcher.is_alive():
                for path in sorted(out.glob("mark-*")):
                    name = path.name[len("mark-"):]
                    if name not in marks:
                        marks[name] = cluster.link_counters(0).total
                        (out / f"ack-{name}").write_text("")
                time.sleep(0.005)
            run = holder.get("run")
            if run is None or not run.ok:
                raise RuntimeError(f"link run ({kind}) failed:\n{run.describe() if run else 'no result'}")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        seconds = max(r["seconds"] for r in ranks)
        rows[kind] = {"samples_per_s": ranks[0]["samples_per_step"] * steps / seconds,
                      "link_bytes_per_step": (marks["end"] - marks["start"]) / steps, "parts": ranks[0]["parts"],
                      "losses": ranks[-1]["losses"]}
    rows["rate_mbit"] = rate_mbit
    rows["pipeline_over_zero3_samples"] = rows["pipeline"]["samples_per_s"] / rows["zero3"]["samples_per_s"]
    rows["zero3_over_pipeline_bytes"] = rows["zero3"]["link_bytes_per_step"] / rows["pipeline"]["link_bytes_per_step"]
    print(f"2 hosts, one rank each, a {rate_mbit:g} Mbit/s link, rank 1 at half speed ({steps} timed steps):")
    for kind in ("pipeline", "zero3"):
        row = rows[kind]
        print(f"  {kind:8s} {row['samples_per_s']:8.1f} samples/s, {row['link_bytes_per_step'] / 2**20:8.2f} MiB "
              f"per step on the link" + (f" (layers {row['parts']})" if row["parts"] else ""))
    print(f"  pipeline / ZeRO-3: {rows['pipeline_over_zero3_samples']:.1f}x the samples/s, "
          f"1/{rows['zero3_over_pipeline_bytes']:.0f} of the bytes")
    return rows


def _number(value):
    return f"{value:9.1f}" if value is not None else f"{'n/a':>9}"


def _share(value):
    return f"{value:6.1%}" if value is not None else f"{'n/a':>6}"


def _mean_of_rounds(runs):
    mean = dict(runs[0])
    mean["samples_per_s"] = sum(run["samples_per_s"] for run in runs) / len(runs)
    mean["rounds"] = [run["samples_per_s"] for run in runs]
    return mean


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each partition, alternating; the mean counts")
    parser.add_argument("--modes", default="dilation,cgroup")
    parser.add_argument("--stages", default="2,3", help="which clusters: 2 and/or 3 stages")
    parser.add_argument("--no-bytes", action="store_true", help="skip the bytes-per-step comparison with ZeRO-3")
    parser.add_argument("--link-mbit", type=float, default=200.0,
                        help="the emulated 2-host run's link rate (root, ip, tc); 0: skip that run")
    parser.add_argument("--link-steps", type=int, default=3)
    args = parser.parse_args()
    link = link_run(args.link_mbit, args.link_steps) if args.link_mbit > 0 else None
    sample_seconds = _full_speed_sample_seconds()
    rows = []
    for stages, speeds in CLUSTERS.items():
        if str(stages) not in args.stages.split(","):
            continue
        for mode in args.modes.split(","):
            # The last case: every stage at full speed, the same layers, upstream's partition (equal
            # stages): what this pipeline achieves with its overheads and bubble, scaled to speeds.
            # It runs first, before any rank has joined a CPU-quota cgroup.
            cases = [dict(partition="parameters", speeds=[1.0] * stages, mode=mode, steps=args.steps)]
            cases += [dict(partition=p, speeds=speeds, mode=mode, steps=args.steps)
                      for _ in range(args.rounds) for p in ("parameters", "heterogeneous")]
            env = {"OMP_NUM_THREADS": "1"}
            try:
                results = [case[0] for case in run_subcases(_run, cases, world_size=stages, timeout=1800, env=env)]
            except AssertionError as error:
                if mode == "cgroup" and "not possible here" in str(error):
                    print(f"{stages} stages, cgroup: skipped (CPU-quota cgroups are not possible on this machine)")
                    continue
                raise
            equal = results.pop(0)
            upstream, hetero = _mean_of_rounds(results[0::2]), _mean_of_rounds(results[1::2])
            bound = 1.0 / balanced_bound([sample_seconds], speeds, MICRO_BATCHES)
            # More stages than cores: at full speed the stages share the cores, which is no bound.
            measured_bound = equal["samples_per_s"] * sum(speeds) / stages if stages <= os.cpu_count() else None
            for name, result in (("parameters", upstream), ("heterogeneous", hetero)):
                parts = result["parts"]
                rows.append({"stages": stages, "speeds": speeds, "mode": mode, "partition": name,
                             "per_stage": result["stages"], "rounds": result["rounds"],
                             "layers_per_stage": [b - a for a, b in zip(parts, parts[1:])],
                             "samples_per_s": result["samples_per_s"], "bound_samples_per_s": bound,
                             "equal_speed_samples_per_s": equal["samples_per_s"],
                             "measured_bound_samples_per_s": measured_bound,
                             "of_measured_bound": result["samples_per_s"] / measured_bound if measured_bound else None,
                             "of_bound": result["samples_per_s"] / bound,
                             "vs_parameters": result["samples_per_s"] / upstream["samples_per_s"]})
    after = _full_speed_sample_seconds()  # the machine may have changed during the runs: both count
    for row in rows:
        row["bound_samples_per_s"] *= sample_seconds / ((sample_seconds + after) / 2)
        row["of_bound"] = row["samples_per_s"] / row["bound_samples_per_s"]
    sample_seconds = (sample_seconds + after) / 2
    print(f"one sample, all {BLOCKS} blocks, forward + backward, one unthrottled thread: {sample_seconds * 1e3:.3f} ms "
          f"(the mean of the medians before and after the runs)")
    header = (f"{'stages':>6}  {'speeds':16}  {'mode':9}  {'partition':13}  {'layers':10}  {'samples/s':>9}  "
              f"{'vs params':>9}  {'bound':>7}  {'of bound':>8}  {'eq. bound':>9}  {'of it':>6}  waiting per stage")
    print(header)
    for row in rows:
        waiting = " ".join(f"{stage['waiting']:.0%}" for stage in row["per_stage"])
        print(f"{row['stages']:6d}  {str(row['speeds']):16}  {row['mode']:9}  {row['partition']:13}  "
              f"{str(row['layers_per_stage']):10}  {row['samples_per_s']:9.1f}  {row['vs_parameters']:8.2f}x  "
              f"{row['bound_samples_per_s']:7.1f}  {row['of_bound']:8.1%}  "
              f"{_number(row['measured_bound_samples_per_s'])}  "
              f"{_share(row['of_measured_bound'])}  {waiting}")
    two = [r for r in rows if r["stages"] == 2 and r["partition"] == "heterogeneous"]
    verdicts = []
    for row in two:
        best = max(row["of_bound"], row["of_measured_bound"] or 0)
        verdicts.append(f"2 stages [1.0, 0.5] ({row['mode']}): {row['vs_parameters']:.2f}x over parameters "
                        f"(target >= {TARGET_GAIN}x: {'met' if row['vs_parameters'] >= TARGET_GAIN else 'missed'}), "
                        f"{row['of_bound']:.0%} of the compute bound and {_share(row['of_measured_bound']).strip()} of "
                        f"the equal-speed bound (target >= {TARGET_BOUND:.0%} of either: "
                        f"{'met' if best >= TARGET_BOUND else 'missed'})")
    print("\n".join(verdicts))
    traffic = None
    if not args.no_bytes:
        # One process group each: a pipeline's process groups stay behind in DeepSpeed's globals.
        pipeline, zero3 = [run_subcases(_bytes_run, [dict(kind=kind, steps=3)], world_size=2, timeout=1200,
                                        env={"OMP_NUM_THREADS": "1"})[0] for kind in ("pipeline", "zero3")]
        traffic = {"pipeline": pipeline, "zero3": zero3}
        print("bytes each rank sends per step (2 ranks, one per host on a 2-host cluster; ring collectives):")
        for name, per_rank in traffic.items():
            print(f"  {name:8s} {', '.join(f'rank {r}: {b / 2**20:.2f} MiB' for r, b in enumerate(per_rank))}")
        ratio = max(zero3) / max(pipeline)
        print(f"  ZeRO-3 / pipeline (busiest rank): {ratio:.1f}x")
        traffic["zero3_over_pipeline"] = ratio
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"sample_seconds_full_speed": sample_seconds, "micro_batches": MICRO_BATCHES,
                                   "micro_batch": MICRO, "rows": rows, "verdicts": verdicts,
                                   "bytes_per_step": traffic, "link": link}, indent=2))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
