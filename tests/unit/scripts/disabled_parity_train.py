"""Train a small fixed-seed model a few steps in several configurations; save rank 0's results.

Run under the ``deepspeed`` launcher. Whichever ``deepspeed`` package the interpreter imports
(the fork, or a pristine upstream on PYTHONPATH) is the one under test; the saved file records
its location so that a parity test can prove which one ran. All cases run in one launch, one
after the other, so that launcher start-up and ``import deepspeed`` are paid once.

    deepspeed --num_gpus 2 disabled_parity_train.py --out results.pt [--expect-deepspeed-in DIR]
"""

import argparse
import os

import torch

IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 32, 8
MICRO_BATCH = 4
DATASET = 64

# name -> the case's settings. ``heterogeneous``: "disabled" puts
# ``heterogeneous_config: {enabled: false}`` in the config, "absent" leaves the key out.
CASES = {
    "zero0-fp32": dict(stage=0, dtype="fp32", gas=1, loader=False, heterogeneous="disabled"),
    "zero1-fp32": dict(stage=1, dtype="fp32", gas=1, loader=False, heterogeneous="disabled"),
    "zero2-fp32": dict(stage=2, dtype="fp32", gas=1, loader=False, heterogeneous="disabled"),
    "zero2-fp32-absent": dict(stage=2, dtype="fp32", gas=1, loader=False, heterogeneous="absent"),
    "zero3-fp32": dict(stage=3, dtype="fp32", gas=1, loader=False, heterogeneous="disabled"),
    "zero0-bf16": dict(stage=0, dtype="bf16", gas=1, loader=False, heterogeneous="disabled"),
    "zero2-bf16": dict(stage=2, dtype="bf16", gas=1, loader=False, heterogeneous="disabled"),
    "zero3-bf16-gas2": dict(stage=3, dtype="bf16", gas=2, loader=False, heterogeneous="disabled"),
    "zero1-fp32-gas2": dict(stage=1, dtype="fp32", gas=2, loader=False, heterogeneous="disabled"),
    "zero2-fp32-loader": dict(stage=2, dtype="fp32", gas=1, loader=True, heterogeneous="disabled"),
    "zero3-fp32-gas2-loader": dict(stage=3, dtype="fp32", gas=2, loader=True, heterogeneous="disabled"),
}


def config(stage, dtype, gas, heterogeneous, world_size):
    result = {
        "train_batch_size": MICRO_BATCH * gas * world_size,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        # torch_adam: FusedAdam would JIT-build another op on the CPU accelerator (minutes).
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        result["bf16"] = {"enabled": True}
    if heterogeneous == "disabled":
        result["heterogeneous_config"] = {"enabled": False}
    return result


def build_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT_FEATURES))


def rank_batch(seed, step, rank, micro_batch):
    # Different data on every rank and micro-step, so that the gradient average across ranks matters.
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    inputs = torch.randn(micro_batch, IN_FEATURES, generator=generator)
    targets = torch.randn(micro_batch, OUT_FEATURES, generator=generator)
    return inputs, targets


def dataset(seed):
    generator = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randn(DATASET, IN_FEATURES, generator=generator)
    targets = torch.randn(DATASET, OUT_FEATURES, generator=generator)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), inputs, targets)


def run_case(deepspeed, rank, world_size, seed, steps, stage, dtype, gas, loader, heterogeneous):
    """Train ``steps`` optimizer steps; return losses, samples seen and the parameters."""
    model = build_model(seed)
    training_data = dataset(seed) if loader else None
    engine, _, train_loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                      config=config(stage, dtype, gas, heterogeneous, world_size),
                                                      training_data=training_data)
    batches = iter(train_loader) if loader else None
    losses, seen = [], []
    for micro_step in range(steps * gas):
        if loader:
            index, inputs, targets = next(batches)
            seen.append(index.tolist())
        else:
            inputs, targets = rank_batch(seed, micro_step, rank, MICRO_BATCH)
        if dtype == "bf16":
            inputs = inputs.to(torch.bfloat16)
        loss = torch.nn.functional.mse_loss(engine(inputs).float(), targets)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert engine.global_steps == steps
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    # The optimizer's fp32 copy of the parameters (ZeRO-0 fp32 has none): in bf16 a difference can
    # stay below the rounding of the bf16 parameters for a few steps, but not of their fp32 masters.
    master = {}
    for name, param in engine.module.named_parameters():
        full = deepspeed.utils.safe_get_full_fp32_param(param)  # a collective in ZeRO 1-3: every rank calls it
        if full is not None:
            master[name] = full.detach().clone()
    # ZeRO-0 bf16 wraps torch's optimizer (FP16_UnfusedOptimizer), which steps fp32 copies instead.
    if not master and hasattr(engine.optimizer, "optimizer"):
        for group_index, group in enumerate(engine.optimizer.optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                master[f"inner optimizer {group_index}.{index}"] = param.detach().clone()
    engine.destroy()
    return {"losses": losses, "seen": seen, "params": params, "master": master}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file for rank 0's results (torch.save)")
    parser.add_argument("--steps", type=int, default=3)
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
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {
        name: run_case(deepspeed, rank, world_size, args.seed, args.steps, **case)
        for name, case in CASES.items()
    }
    if rank == 0:
        torch.save({"deepspeed_file": location, "deepspeed_version": deepspeed.__version__, "cases": results},
                   args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
