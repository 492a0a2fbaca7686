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

from bench_pipeline import MICRO, MICRO_BATCHES, _blocks, _dataset  # noqa: E402
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
    from deepspeed.pipe import PipelineModule

    torch.set_num_threads(1)
    deepspeed.init_distributed()  # a PipelineModule needs the process group before the engine
    batch = MICRO * MICRO_BATCHES
    config = {"train_batch_size": batch, "gradient_accumulation_steps": MICRO_BATCHES, "steps_per_print": 10**9,
              "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}, "zero_allow_untested_optimizer": True,
              "heterogeneous_config": {"enabled": True, "profile_steps": 0,
                                       "emulation": {"speeds": [1.0, 0.5], "mode": "dilation"}}}
    data = _dataset(batch * (args.steps + args.warmup + 1))
    if args.kind == "pipeline":
        net = PipelineModule(layers=_blocks(), num_stages=2, loss_fn=torch.nn.MSELoss(),
                             partition_method="heterogeneous")
        engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config,
                                               training_data=data)

        def step():
            return float(engine.train_batch())
    else:
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

    for _ in range(args.warmup):
        step()
    mark(args.out, "start")
    began = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    dist.barrier()
    seconds = time.perf_counter() - began
    mark(args.out, "end")
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps({
        "kind": args.kind, "seconds": seconds, "steps": args.steps, "samples_per_step": batch, "losses": losses,
        "parts": [int(p) for p in engine.module.parts] if args.kind == "pipeline" else None}))


if __name__ == "__main__":
    main()
