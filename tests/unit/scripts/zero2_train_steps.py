"""Train a small fixed-seed model a few ZeRO-2 steps and save rank 0's parameters.

Run under the ``deepspeed`` launcher. Whichever ``deepspeed`` package the interpreter imports
(the fork, or a pristine upstream on PYTHONPATH) is the one under test; the saved file records
its location so that a parity test can prove which one ran.

    deepspeed --num_gpus 2 zero2_train_steps.py --out params.pt [--expect-deepspeed-in DIR]
"""

import argparse
import os

import torch

CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    # torch_adam: FusedAdam would JIT-build another op on the CPU accelerator (minutes).
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "heterogeneous_config": {"enabled": False},
    "steps_per_print": 1000,
}
IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 32, 8


def build_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT_FEATURES))


def rank_batch(seed, step, rank, micro_batch):
    # Different data on every rank and step, so that the gradient average across ranks matters.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    inputs = torch.randn(micro_batch, IN_FEATURES, generator=generator)
    targets = torch.randn(micro_batch, OUT_FEATURES, generator=generator)
    return inputs, targets


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file for rank 0's parameters (torch.save)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--expect-deepspeed-in", help="fail unless deepspeed is imported from below this directory")
    parser.add_argument("--local_rank", type=int, default=0, help="appended by the launcher")
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist

    location = os.path.realpath(deepspeed.__file__)
    print(f"deepspeed.__file__ = {location}", flush=True)
    if args.expect_deepspeed_in:
        expected = os.path.realpath(args.expect_deepspeed_in)
        if os.path.commonpath([location, expected]) != expected:
            raise SystemExit(f"deepspeed was imported from {location}, not from below {expected}")

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_model(args.seed)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=dict(CONFIG))
    losses = []
    for step in range(args.steps):
        inputs, targets = rank_batch(args.seed, step, rank, CONFIG["train_micro_batch_size_per_gpu"])
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())

    if rank == 0:
        torch.save({
            "deepspeed_file": location,
            "deepspeed_version": deepspeed.__version__,
            "losses": losses,
            "params": {name: param.detach().clone()
                       for name, param in engine.module.named_parameters()},
        }, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
