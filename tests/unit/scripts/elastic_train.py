# SPDX-License-Identifier: Apache-2.0
"""An elastic heterogeneous run under ``torchrun --nnodes MIN:MAX --max-restarts K``, run by
tests/unit/heterogeneous/test_elastic.py and tests/perf/bench_elastic.py.

Every attempt builds its config for the world it was given (one micro-batch size and memory share
per rank: [4, 3, 1] on 3 ranks, [6, 2] on 2, [3, 2, 2, 1] on 4), loads the newest periodic
checkpoint if there is one (``engine.load_checkpoint(dir)``: a checkpoint of another world is
re-partitioned by the fork) and trains ZeRO-2 Adam to ``--steps``, the engine saving every
``--every`` steps. The agent started with ``ELASTIC_VICTIM=1`` kills itself and its worker after
step ``--kill-at`` of a 3-rank attempt: a node lost. Each rank appends JSON lines to
``<out>/events.jsonl``: ``start`` (attempt, world, rank), ``loaded`` (the step loaded, the line
printed), ``step`` (the indices it fed, the time), ``kill``; rank 0 of the attempt that finishes
writes ``<out>/final.pt`` (the full fp32 parameters).

    torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        --max-restarts 2 tests/unit/scripts/elastic_train.py --out DIR
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit: the shared dataset
from references import RecordingDataset  # noqa: E402

WIDTH, SAMPLES, BATCH, LR = 16, 96, 8, 1e-2
PLANS = {1: ([8], None), 2: ([6, 2], [0.7, 0.3]), 3: ([4, 3, 1], [0.5, 0.3, 0.2]),
         4: ([3, 2, 2, 1], [0.4, 0.3, 0.2, 0.1])}


def samples():
    """Deterministic samples; the dataset records the indices it hands out."""
    return RecordingDataset(SAMPLES, WIDTH, seed=5)


class CountingModel(torch.nn.Module):
    """An MLP with a buffer, ``forwards`` (training forwards so far), that a load must restore: a
    universal load restores parameters only."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, inputs):
        if self.training:
            self.forwards += 1
        return self.net(inputs)


def agent_attempt(out):
    """How many workers this worker's agent (its parent process) started before it. Not
    TORCHELASTIC_RESTART_COUNT: an agent restarts its worker for a membership change without
    counting it, so two agents' counts differ when one's worker failed first and the other's was
    restarted by the new round."""
    path = os.path.join(out, f"starts-{os.getppid()}")
    with open(path, "a+") as starts:
        starts.seek(0)
        attempt = len(starts.read().split())
        starts.write(f"{os.getpid()}\n")
    return attempt


def make_model():
    torch.manual_seed(20261205)
    return CountingModel()


def config(world_size, stage=2, elastic=None):
    """ZeRO-``stage`` Adam, fp32, this world's plan and memory shares; ``elastic``: the
    ``heterogeneous_config.elastic`` block."""
    sizes, shares = PLANS[world_size]
    heterogeneous = {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes,
                     "mixed_precision_support": "fp32", "elastic": elastic or {}}
    return {"train_batch_size": BATCH, "steps_per_print": 1000, "gradient_clipping": 0.0,
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "heterogeneous_config": heterogeneous,
            "heterogeneous_memory": {"zero_partitions": shares or "even"}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds added to every step")
    args = parser.parse_args()
    import deepspeed
    from deepspeed.runtime.heterogeneous.process_exit import end_process
    from deepspeed.utils import safe_get_full_fp32_param

    began = time.time()
    deepspeed.init_distributed("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = agent_attempt(args.out)
    victim = os.environ.get("ELASTIC_VICTIM") == "1"
    folder = os.path.join(args.out, "checkpoints")
    events = open(os.path.join(args.out, "events.jsonl"), "a")

    def event(kind, **fields):
        events.write(json.dumps({"kind": kind, "attempt": attempt, "world": world, "rank": rank, "victim": victim,
                                 "time": time.time(), **fields}) + "\n")
        events.flush()

    event("start", began=began)
    data = samples()
    model = make_model()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config(world, elastic={"checkpoint": {
                                                    "dir": folder, "every_steps": args.every, "keep_last": 0}}),
                                                training_data=data)
    if os.path.isfile(os.path.join(folder, "latest")):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            engine.load_checkpoint(folder)
        sys.stdout.write(printed.getvalue())
        event("loaded", step=engine.global_steps, printed=printed.getvalue())
    iterator = iter(loader)
    while engine.global_steps < args.steps:
        start = len(data.seen)
        for _ in range(engine.gradient_accumulation_steps()):
            try:
                inputs, targets = next(iterator)
            except StopIteration:  # the next epoch: a new permutation
                loader.batch_sampler.set_epoch(loader.batch_sampler.epoch + 1)
                iterator = iter(loader)
                inputs, targets = next(iterator)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            time.sleep(args.step_sleep / engine.gradient_accumulation_steps())
            engine.step()
        event("step", step=engine.global_steps, fed=data.seen[start:])
        if victim and world == 3 and engine.global_steps == args.kill_at:
            event("kill", step=engine.global_steps)
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: the node is gone
            os.kill(os.getpid(), signal.SIGKILL)
    params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    if rank == 0:
        torch.save({"params": params, "world": world, "attempt": attempt}, os.path.join(args.out, "final.pt"))
    event("done", step=engine.global_steps)
    events.close()
    end_process(0)


if __name__ == "__main__":
    main()
