# SPDX-License-Identifier: Apache-2.0
"""A stock Hugging Face Accelerate loop with heterogeneous_config, run by
tests/unit/heterogeneous/test_accelerate_loop.py under the ``deepspeed`` launcher and under
``accelerate launch``.

The loop is Accelerate's own, unchanged, with the fork's config in its DeepSpeedPlugin:

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step(); optimizer.zero_grad()

Accelerate feeds every rank an equal batch; the engine re-splits them into the plan (rank 1
emulated at a tenth of rank 0's speed, PROFILE profiling steps that move work to rank 0, then
``model.reschedule_workload`` at step RESCHEDULE_AT with rank 1 the faster per sample) and returns
the outputs to the ranks fed them. Next to it each rank trains a reference in plain torch, in
this process, on the union of what every rank was fed at the step (gathered with
``all_gather_object``). Runs once per case given on the command line, each with a fresh
Accelerator and engine:

- ``mse``: regression to 8 targets, mean squared error.
- ``accuracy``: 4 classes, cross entropy, and per step the accuracy of the rank's outputs next
  to the reference's on the same rows.

Rank and world size come from the environment (RANK, WORLD_SIZE: both launchers set them); the
ranks run on the CPU accelerator with gloo (DS_ACCELERATOR=cpu). Each rank writes
``<out>/<launcher>-<case>-rank<r>.pt``: ``plans`` (the plan's micro-batch sizes after every
step), ``params`` and ``outputs`` (the largest absolute difference from the reference of the
trained parameters and of any step's outputs) and ``metrics`` (``[(accuracy, reference's)]`` per
step; empty for ``mse``).

    deepspeed --num_gpus 2 tests/unit/scripts/accelerate_loop.py --out DIR --launcher deepspeed --case mse
    accelerate launch --use_deepspeed --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no tests/unit/scripts/accelerate_loop.py --out DIR --launcher accelerate --case mse
"""

import argparse
import os

import torch

BATCH, WIDTH, HIDDEN, STEPS, PROFILE, RESCHEDULE_AT = 16, 256, 2048, 9, 5, 7
CASES = {"mse": False, "accuracy": True}  # case -> whether it has the accuracy metric


def accelerate_loop(rank, world_size, metric):
    import torch.distributed as tdist
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    AcceleratorState._reset_state(True)  # one Accelerator per case (the cases share a process)
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(BATCH * STEPS, WIDTH, generator=generator)
    classes = 4 if metric else None
    targets = (torch.randint(0, classes, (BATCH * STEPS, ), generator=generator) if classes else
               torch.randn(BATCH * STEPS, 8, generator=generator))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, classes or 8))
    reference = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Tanh(),
                                    torch.nn.Linear(HIDDEN, classes or 8))
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    ds_config = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world_size,
                 "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
                 "zero_optimization": {"stage": 1},
                 "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                          "profile_steps": PROFILE,
                                          "emulation": {"speeds": [1.0, 0.1], "mode": "dilation"}}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(features, targets), batch_size=BATCH // world_size, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_fn = torch.nn.functional.cross_entropy if classes else torch.nn.functional.mse_loss
    plans, worst, metrics = [], 0.0, []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        if step == RESCHEDULE_AT:
            model.reschedule_workload(utilization_metrics=[1.0, 0.05])  # rank 1 now the faster per sample
        fed = [None] * world_size
        tdist.all_gather_object(fed, (x, y))  # the script's own view of what every rank was fed
        gx, gy = torch.cat([f[0] for f in fed]), torch.cat([f[1] for f in fed])
        mine = slice(sum(len(f[0]) for f in fed[:rank]), sum(len(f[0]) for f in fed[:rank + 1]))
        ref_out = reference(gx)
        out = model(x)
        accelerator.backward(loss_fn(out, y))
        optimizer.step()
        optimizer.zero_grad()
        worst = max(worst, (out.detach() - ref_out[mine].detach()).abs().max().item())
        if classes:
            metrics.append(((out.argmax(-1) == y).float().mean().item(),
                            (ref_out[mine].argmax(-1) == gy[mine]).float().mean().item()))
        ref_opt.zero_grad()
        loss_fn(ref_out, gy).backward()
        ref_opt.step()
        plans.append(list(model.heterogeneous_plan.micro_batch_sizes))
    params = max((a.detach() - b.detach()).abs().max().item()
                 for a, b in zip(model.module.parameters(), reference.parameters()))
    return {"plans": plans, "params": params, "outputs": worst, "metrics": metrics}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # passed by the deepspeed launcher; unused
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", action="append", required=True, choices=sorted(CASES))
    parser.add_argument("--launcher", required=True, help="a label for the result files' names")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        for case in args.case:
            result = accelerate_loop(rank, world_size, CASES[case])
            torch.save(result, os.path.join(args.out, f"{args.launcher}-{case}-rank{rank}.pt"))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
