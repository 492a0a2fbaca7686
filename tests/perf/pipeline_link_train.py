# SPDX-License-Identifier: Apache-2.0
"""One rank of ``bench_pipeline.py --link-mbit``: the benchmark's blocks on an emulated 2-host
cluster (one rank per host, a ``tbf``-shaped link between them), trained either as the 2-stage
heterogeneous pipeline or as ZeRO-3 data parallelism of the same blocks, rank 1 at half speed in
both (``emulation.mode: dilation``).

Run by ``scripts/emulated_cluster.py``'s launcher on every host. After the warm-up steps and after
the timed ones, every rank stops at a mark (``comm_train.mark``: a file ``mark-<name>`` in
``--out`` that the benchmark answers after reading the link's ``tc`` byte counters). Each rank
writes ``<out>/rank<R>.json``: the timed steps' seconds and losses.
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parents[1] / "tests" / "unit"), str(HERE)]

import torch  # noqa: E402

from bench_pipeline import MICRO, MICRO_BATCHES, two_rank_step  # noqa: E402
from comm_train import mark  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=("pipeline", "zero3"), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    import deepspeed
    from deepspeed import comm as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed()  # a PipelineModule needs the process group before the engine
    step, parts = two_rank_step(args.kind, args.steps + args.warmup)

    for _ in range(args.warmup):
        step()
    mark(args.out, "start")
    began = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    dist.barrier()
    seconds = time.perf_counter() - began
    mark(args.out, "end")
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps({
        "kind": args.kind, "seconds": seconds, "steps": args.steps, "samples_per_step": MICRO * MICRO_BATCHES,
        "losses": losses, "parts": parts}))


if __name__ == "__main__":
    main()
