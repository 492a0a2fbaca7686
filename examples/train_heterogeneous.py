# SPDX-License-Identifier: Apache-2.0
"""A short data-parallel training run with a heterogeneous_config block.

Launched by examples/heterogeneous_demo.py through the real ``deepspeed`` launcher; it can be run
by hand the same way:

    deepspeed --num_gpus 2 examples/train_heterogeneous.py --deepspeed_config CONFIG --steps 20
"""

import argparse
import json

import torch

import deepspeed
from deepspeed.accelerator import get_accelerator


def make_model(width):
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(1234)
    model = make_model(args.width)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank, world = engine.global_rank, engine.world_size
    settings = engine._config.heterogeneous
    if rank == 0:
        print(f"[demo] heterogeneous_config: enabled={settings.enabled}, "
              f"strategy={settings.config.load_balancing_strategy}, "
              f"dynamic_rebalancing={settings.config.scheduler.dynamic_rebalancing}, "
              f"emulation={settings.config.emulation.model_dump() if settings.config.emulation else None}",
              flush=True)

    # A fixed teacher makes the loss meaningful: the student must learn it.
    generator = torch.Generator().manual_seed(99)
    teacher = make_model(args.width)
    micro_batch = engine.train_micro_batch_size_per_gpu()
    device = get_accelerator().current_device_name()
    for step in range(args.steps):
        inputs = torch.randn(micro_batch, args.width, generator=generator)[rank::1].to(device)
        with torch.no_grad():
            targets = teacher(inputs)
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"[demo] step {step:3d}  loss {loss.item():.5f}", flush=True)
    if rank == 0:
        print(json.dumps({"demo_done": True, "world_size": world, "steps": args.steps}), flush=True)


if __name__ == "__main__":
    main()
