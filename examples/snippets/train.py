# SPDX-License-Identifier: Apache-2.0
"""The smallest training script for a README config: a small MLP on random data.

    deepspeed --num_gpus 2 examples/snippets/train.py --deepspeed_config examples/configs/seed.json
    python examples/snippets/train.py --deepspeed_config examples/configs/seed.json   # one process
"""

import argparse

import torch

import deepspeed


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                training_data=data)
    # The precision the config chose: `mixed_precision_support: adaptive` trains in bf16 where every
    # rank supports it (CPUs do), so the inputs must follow the model's dtype, not stay fp32.
    dtype, _ = engine.get_data_types()
    batches = iter(loader)
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            inputs, targets = (t.to(engine.device, dtype) for t in next(batches))
            loss = torch.nn.functional.mse_loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
        if engine.global_rank == 0:
            plan = engine.heterogeneous_plan
            print(f"step {step}: loss {loss.item():.4f}, dtype {dtype}, "
                  f"micro-batches {list(plan.micro_batch_sizes) if plan else None}", flush=True)
    # Shut down cleanly: a collective still finishing in one of gloo's worker threads when the
    # interpreter exits aborts the process ("terminate called without an active exception"). The
    # barrier waits for every earlier collective; then the process groups go.
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
