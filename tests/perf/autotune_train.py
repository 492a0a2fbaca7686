# SPDX-License-Identifier: Apache-2.0
"""Train the small GPT (examples/tiny_gpt, ``GPTConfig.bench()``) with one torch thread per rank;
the training script of tests/perf/bench_autotuning.py.

    deepspeed --autotuning tune --num_gpus 2 tests/perf/autotune_train.py --deepspeed_config ds.json

It runs micro-steps until the engine stops it: with autotuning enabled in the ds_config the
engine writes the experiment's metrics after ``end_profile_step + 1`` optimizer steps and exits.
Without autotuning (e.g. ds_config_optimal.json) it stops after ``--steps`` optimizer steps.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import deepspeed  # noqa: E402
from examples.tiny_gpt import GPT, GPTConfig, TokenDataset, split_batch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps when autotuning does not stop it")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)  # one core per rank: the emulated devices must not share cores
    model = GPT(GPTConfig.bench(), seed=0)
    dataset = TokenDataset(seq_len=model.config.seq_len, num_samples=4096, seed=0)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=dataset)
    batches = iter(loader)
    while engine.global_steps < args.steps:
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        inputs, targets = split_batch(batch.to(engine.device))
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()  # steps the optimizer at each accumulation boundary (per-rank gas included)
    from deepspeed.runtime.heterogeneous.cli.process_exit import end_process
    end_process(0)  # else gloo's threads may abort the interpreter's exit


if __name__ == "__main__":
    main()
