# SPDX-License-Identifier: Apache-2.0
"""Train the small GPT on the generated corpus with a heterogeneous_config; one JSON line per
logged step and a summary line, for examples/heterogeneous_demo.py.

    deepspeed --num_gpus 2 examples/train_heterogeneous.py --deepspeed_config ds_config.json --steps 40
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
from deepspeed import comm as dist  # noqa: E402
from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch  # noqa: E402

MEASURE_FROM = 5  # steps before this one (start-up, profiling) are left out of samples/s


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: the emulated devices must not share cores
    model = GPT(GPTConfig.demo(), seed=0)
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=8192, seed=0)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    rank = engine.global_rank
    batches = iter(loader)
    start = None
    for step in range(args.steps):
        if step == MEASURE_FROM:
            dist.barrier()
            start = time.perf_counter()
        inputs, targets = split_batch(next(batches).to(engine.device))
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        # The global batch's loss: every rank's mean weighted by its share of the samples.
        share = torch.tensor([loss.item() * len(inputs), float(len(inputs))])
        dist.all_reduce(share)
        if rank == 0:
            plan = engine.heterogeneous_plan
            print(json.dumps({"step": step, "loss": share[0].item() / share[1].item(),
                              "plan": list(plan.micro_batch_sizes) if plan else None}), flush=True)
    dist.barrier()
    elapsed = time.perf_counter() - start
    runtime = engine._heterogeneous_runtime()
    modes = [None] * dist.get_world_size()
    dist.all_gather_object(modes, runtime.emulation_mode if runtime else "none")
    if rank == 0:
        samples = engine.train_batch_size() * (args.steps - MEASURE_FROM)
        print(json.dumps({"summary": True, "samples_per_s": samples / elapsed,
                          "emulation": "/".join(sorted(set(modes) - {"none"})) or "none"}), flush=True)


if __name__ == "__main__":
    main()
