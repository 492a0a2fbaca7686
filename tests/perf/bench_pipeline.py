# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous pipeline stages against upstream's ``parameters`` partition, on one emulated cluster.

A ``PipelineModule`` of 12 residual MLP blocks (width 256, hidden 1024), 8 micro-batches of 16
samples per step, one replica (data-parallel size 1), SGD. Every stage is one CPU process with one
thread. For each emulated cluster it runs, in one invocation and one process group:

- ``parameters``: upstream's partition (equal parameters per stage, so equal blocks);
- ``heterogeneous``: ``partition_method="heterogeneous"``: blocks in proportion to stage speed.

Clusters: 2 stages at speeds [1.0, 0.5] and 3 stages at [1.0, 0.5, 0.5], each by time dilation and
by CPU-quota cgroups (where the machine allows them; skipped otherwise).

It prints samples/s, the ratio heterogeneous / parameters, the layers per stage, and the ratio of
each to the balanced pipeline's bound: ``sum(stage speeds) / t`` samples/s, ``t`` one sample's
forward and backward through all blocks on one unthrottled thread (measured here, before the
runs), times ``m / (m + S - 1)`` for the bubble of m micro-batches through S stages. Results go
to ``tests/perf/results/pipeline.json``. Targets (reported, not asserted): >= 1.3x over
``parameters`` at [1.0, 0.5], and >= 90% of the bound.

    python tests/perf/bench_pipeline.py [--steps N] [--modes dilation,cgroup]   (repository root, ~5 min)
"""

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from harness import run_subcases  # noqa: E402

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
    for _ in range(WARMUP):
        engine.train_batch()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_batch()
    dist.barrier()
    seconds = time.perf_counter() - start
    return {"samples_per_s": batch * steps / seconds, "parts": [int(p) for p in net.parts],
            "mode": engine._heterogeneous_runtime().limits.mode}


def _full_speed_sample_seconds(repeats=6):
    """One sample's forward and backward through all blocks on one thread at full speed."""
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*_blocks())
    inputs, targets = _dataset(MICRO).tensors
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(MICRO_BATCHES):
            model.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
        best = min(best, time.perf_counter() - start)
    return best / (MICRO * MICRO_BATCHES)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--modes", default="dilation,cgroup")
    args = parser.parse_args()
    sample_seconds = _full_speed_sample_seconds()
    print(f"one sample, all {BLOCKS} blocks, forward + backward, one unthrottled thread: {sample_seconds * 1e3:.3f} ms")
    rows = []
    for stages, speeds in CLUSTERS.items():
        for mode in args.modes.split(","):
            cases = [dict(partition=p, speeds=speeds, mode=mode, steps=args.steps) for p in ("parameters",
                                                                                               "heterogeneous")]
            env = {"OMP_NUM_THREADS": "1"}
            try:
                upstream, hetero = [case[0] for case in run_subcases(_run, cases, world_size=stages, timeout=1200,
                                                                     env=env)]
            except AssertionError as error:
                if mode == "cgroup" and "not possible here" in str(error):
                    print(f"{stages} stages, cgroup: skipped (CPU-quota cgroups are not possible on this machine)")
                    continue
                raise
            bubble = MICRO_BATCHES / (MICRO_BATCHES + stages - 1)
            bound = sum(speeds) / sample_seconds * bubble
            for name, result in (("parameters", upstream), ("heterogeneous", hetero)):
                parts = result["parts"]
                rows.append({"stages": stages, "speeds": speeds, "mode": result["mode"], "partition": name,
                             "layers_per_stage": [b - a for a, b in zip(parts, parts[1:])],
                             "samples_per_s": result["samples_per_s"], "bound_samples_per_s": bound,
                             "of_bound": result["samples_per_s"] / bound,
                             "vs_parameters": result["samples_per_s"] / upstream["samples_per_s"]})
    header = (f"{'stages':>6}  {'speeds':16}  {'mode':9}  {'partition':13}  {'layers':10}  {'samples/s':>9}  "
              f"{'vs params':>9}  {'bound':>7}  {'of bound':>8}")
    print(header)
    for row in rows:
        print(f"{row['stages']:6d}  {str(row['speeds']):16}  {row['mode']:9}  {row['partition']:13}  "
              f"{str(row['layers_per_stage']):10}  {row['samples_per_s']:9.1f}  {row['vs_parameters']:8.2f}x  "
              f"{row['bound_samples_per_s']:7.1f}  {row['of_bound']:8.1%}")
    two = [r for r in rows if r["stages"] == 2 and r["partition"] == "heterogeneous"]
    verdicts = []
    for row in two:
        verdicts.append(f"2 stages [1.0, 0.5] ({row['mode']}): {row['vs_parameters']:.2f}x over parameters "
                        f"(target >= {TARGET_GAIN}x: {'met' if row['vs_parameters'] >= TARGET_GAIN else 'missed'}), "
                        f"{row['of_bound']:.0%} of the bound (target >= {TARGET_BOUND:.0%}: "
                        f"{'met' if row['of_bound'] >= TARGET_BOUND else 'missed'})")
    print("\n".join(verdicts))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"sample_seconds_full_speed": sample_seconds, "micro_batches": MICRO_BATCHES,
                                   "micro_batch": MICRO, "rows": rows, "verdicts": verdicts}, indent=2))
    print(f"wrote {RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
