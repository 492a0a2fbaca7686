# SPDX-License-Identifier: Apache-2.0
"""One rank of the multi-host exactness run (tests/unit/heterogeneous/test_multihost.py).

Started by the real ``deepspeed`` launcher on every emulated host (``scripts/emulated_cluster.py``).
Runs every case named by ``--cases`` in this one process (start-up is paid once), each through
``deepspeed.initialize`` with the fork enabled, and saves what the test checks to
``<out>/rank<R>.pt``: per case the trained parameters and the samples each step took, and this
rank's view of its host (environment, topology, device description).
"""

import argparse
import os

import torch

WIDTH = 16
DATASET = 96
LR = 1e-3


def make_model():
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 32), torch.nn.Tanh(), torch.nn.Linear(32, WIDTH))


def dataset():
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(DATASET, WIDTH, generator=generator)
    targets = torch.randn(DATASET, WIDTH, generator=generator)
    return torch.utils.data.TensorDataset(torch.arange(DATASET), inputs, targets)


def base_config(stage, batch, gas, heterogeneous):
    return {"train_batch_size": batch, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "heterogeneous_config": heterogeneous}


# name -> (ZeRO stage, gas, manual micro-batch sizes per rank or None for compute_aware)
CASES = {
    "zero0": (0, 2, {2: [5, 3], 3: [5, 3, 4], 4: [5, 3, 2, 6]}),
    "zero1": (1, 1, {2: [7, 1], 3: [7, 1, 4], 4: [7, 1, 4, 4]}),
    "zero2": (2, 2, {2: [5, 3], 3: [2, 6, 4], 4: [5, 3, 6, 2]}),
    "zero3": (3, 1, {2: [3, 5], 3: [3, 5, 4], 4: [3, 5, 2, 6]}),
    "compute_aware": (2, 1, None),
}


def run_manual(stage, gas, sizes, rank):
    """Rank ``rank`` trains on its contiguous slice of every global micro-batch (the sampler's rule)."""
    import deepspeed

    model = make_model()
    config = base_config(stage, sum(sizes) * gas, gas,
                         {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": sizes})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert list(engine.heterogeneous_plan.micro_batch_sizes) == sizes
    _, inputs, targets = dataset().tensors
    seen, per_step = [], sum(sizes) * gas
    for step in range(DATASET // per_step):
        taken = []
        for micro in range(gas):
            start = step * per_step + micro * sum(sizes) + sum(sizes[:rank])
            chunk = list(range(start, start + sizes[rank]))
            taken += chunk
            engine.backward(torch.nn.functional.mse_loss(engine(inputs[chunk]), targets[chunk]))
            engine.step()
        seen.append(taken)
    return engine, seen


def run_compute_aware(stage, world_size):
    """Compute-aware with the second host's ranks emulated at a quarter speed: profiling moves
    work to the first host's ranks (a plan change) and the engine's loader follows it."""
    import deepspeed

    model = make_model()
    speeds = [1.0 if r < 2 else 0.25 for r in range(world_size)]  # host 0 runs ranks 0 and 1
    config = base_config(stage, 16, 1, {"enabled": True, "load_balancing_strategy": "compute_aware",
                                        "profile_steps": 3, "emulation": {"speeds": speeds, "mode": "dilation"}})
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset())
    start_plan = list(engine.heterogeneous_plan.micro_batch_sizes)
    seen = []
    batches = iter(loader)
    for _ in range(DATASET // 16):
        index, inputs, targets = next(batches)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
        seen.append(index.tolist())
    return engine, seen, start_plan


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()

    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from deepspeed.runtime.heterogeneous.emulation.cgroups import memory_limit
    result = {"env": {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "CROSS_RANK", "CROSS_SIZE",
                                                               "LOCAL_SIZE", "GLOO_SOCKET_IFNAME",
                                                               "DS_ADAPTIVE_SCHEDULING")},
              "memory_limit": memory_limit(),  # the host's cgroup, seen from inside its namespace
              "cases": {}}
    for name in args.cases.split(","):
        stage, gas, sizes = CASES[name]
        entry = {}
        if sizes is None:
            engine, seen, entry["start_plan"] = run_compute_aware(stage, world_size)
        else:
            engine, seen = run_manual(stage, gas, sizes[world_size], rank)
        state = engine._config.heterogeneous
        topology = state.topology
        entry.update(seen=seen, plan=list(engine.heterogeneous_plan.micro_batch_sizes),
                     topology=None if topology is None else topology.to_dict(),
                     local_ranks=None if topology is None else list(topology.local_ranks),
                     device_local_ranks=None if state.devices is None else [d.local_rank for d in state.devices])
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
            entry["params"] = [p.detach().clone() for p in engine.module.parameters()]
        result["cases"][name] = entry
    torch.save(result, os.path.join(args.out, f"rank{rank}.pt"))
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
