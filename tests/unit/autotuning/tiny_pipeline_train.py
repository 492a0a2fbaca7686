# SPDX-License-Identifier: Apache-2.0
"""A small pipeline training script for the autotuning tests: a PipelineModule of a few Linear
layers whose stages the fork cuts as the engine starts (``partition_method="heterogeneous"``),
trained with ``engine.train_batch()``. The pipeline degree is the script's flag, as in real
scripts; the autotuner passes it through ``autotuning.arg_mappings``.

    deepspeed --autotuning tune --num_gpus 2 tiny_pipeline_train.py --deepspeed_config ds_config.json

--stages S          the pipeline degree (PipelineModule(num_stages=S)); must divide the ranks
--steps N           optimizer steps (train_batch calls); the autotuner's window ends before
--sleep-per-sample  sleeps S seconds per sample in every Linear's forward: compute that dominates,
                    and that the emulation's time dilation stretches like real compute
"""

import argparse
import time

import torch

import deepspeed
from deepspeed.pipe import PipelineModule

WIDTH = 32
LAYERS = 6


class SleepyLinear(torch.nn.Linear):

    def __init__(self, width, per_sample):
        super().__init__(width, width)
        self.per_sample = per_sample

    def forward(self, x):
        if self.per_sample:
            time.sleep(self.per_sample * len(x))
        return torch.tanh(super().forward(x))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sleep-per-sample", type=float, default=0.0)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = PipelineModule(layers=[SleepyLinear(WIDTH, args.sleep_per_sample) for _ in range(LAYERS)],
                         num_stages=args.stages, loss_fn=torch.nn.MSELoss(), partition_method="heterogeneous")
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(4096, WIDTH, generator=generator),
                                          torch.randn(4096, WIDTH, generator=generator))
    engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(), training_data=data)
    for _ in range(args.steps):
        engine.train_batch()
    if engine.global_rank == 0:
        print(f"training finished after {args.steps} steps with {args.stages} stage(s)", flush=True)
    # As tiny_train.py: leave without interpreter finalization, where gloo's threads can abort a rank.
    from deepspeed.runtime.heterogeneous.cli.process_exit import end_process
    end_process(0)


if __name__ == "__main__":
    main()
