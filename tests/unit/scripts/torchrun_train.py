# SPDX-License-Identifier: Apache-2.0
"""A short heterogeneous run under ``torchrun`` (not the ``deepspeed`` launcher), run by
tests/unit/heterogeneous/test_torchrun.py. The plan changes on demand to [12, 4] after step 2
(rank 1 reported three times slower, at the end of step 2); ``--loader`` says what feeds the ranks:

- ``engine``: the engine's loader (``deepspeed.initialize(training_data=...)``): each rank its share;
- ``stock``: a stock ``DistributedSampler`` loader (equal batches), which the engine re-splits;
- ``refused``: the same stock loader with ``resplit_fed_batches: false``: every rank stops with
  ``FedBatchMismatchError`` at the first forward after the change.

Each rank writes ``<out>/<loader>-rank<r>.pt``: the plans, the dataset rows it was fed, and the
trained parameters (or the error).

    torchrun --nproc_per_node 2 tests/unit/scripts/torchrun_train.py --out DIR --loader stock
"""

import argparse
import os
import sys

import torch

WIDTH, BATCH, STEPS, CHANGE_AT = 16, 16, 5, 2


def dataset():
    generator = torch.Generator().manual_seed(4)
    return torch.utils.data.TensorDataset(torch.arange(BATCH * STEPS), torch.randn(BATCH * STEPS, WIDTH, generator=generator),
                                          torch.randn(BATCH * STEPS, WIDTH, generator=generator))


def make_model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 64), torch.nn.Tanh(), torch.nn.Linear(64, WIDTH))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--loader", choices=["engine", "stock", "refused"], required=True)
    args = parser.parse_args()
    import deepspeed
    from deepspeed.runtime.heterogeneous.data.fed_batch import FedBatchMismatchError
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = {"train_batch_size": BATCH, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                                       "profile_steps": 0, "resplit_fed_batches": args.loader != "refused"}}
    model = make_model()
    data = dataset()
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=data if args.loader == "engine" else None)
    if args.loader != "engine":
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH // world_size, sampler=sampler, drop_last=True)
    result = {"plans": [], "fed": [], "error": None}
    try:
        for step, (index, x, y) in enumerate(loader):
            if step == STEPS:
                break
            result["plans"].append(list(engine.heterogeneous_plan.micro_batch_sizes))
            result["fed"].append(index.tolist())
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            if step == CHANGE_AT - 1:  # at a step boundary, as a callback would
                engine.reschedule_workload(utilization_metrics=[1.0, 3.0])
    except FedBatchMismatchError as error:
        result["error"] = str(error)
    result["params"] = [p.detach().clone() for p in engine.module.parameters()]
    torch.save(result, os.path.join(args.out, f"{args.loader}-rank{rank}.pt"))
    torch.distributed.barrier()  # both ranks saved
    # Skip the interpreter's teardown: gloo's threads sometimes abort a rank there ("terminate
    # called without an active exception"), after the run's work is done and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
