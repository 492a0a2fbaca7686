# SPDX-License-Identifier: Apache-2.0
"""The heterogeneous profiler around a few training steps (run from the repository root).

    deepspeed --num_gpus 2 examples/snippets/profiler.py
"""

import torch

import deepspeed
from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler

model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
data = torch.utils.data.TensorDataset(torch.randn(1024, 16), torch.randn(1024, 1))

engine, optimizer, loader, _ = deepspeed.initialize(model=model, config="examples/configs/profiler.json", training_data=data)
batches = iter(loader)
profiler = HeterogeneousProfiler(engine)        # or the module you passed to deepspeed.initialize
profiler.start_heterogeneous_profile()          # every rank, between two optimizer steps
for _ in range(20):                             # train as usual
    inputs, targets = next(batches)
    loss = torch.nn.functional.mse_loss(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
profiler.stop_profile()                         # every rank, same step (gathers all ranks' records)
profiler.print_heterogeneous_metrics()          # rank 0: utilisation, comm (transfer/wait), memory; ok/LOW/HIGH
print(profiler.get_device_utilization())        # busy / step time per data-parallel rank, e.g. [0.81, 0.93]
profiler.save("hetero_profile")                 # rank 0: profile.json and timeline.png (needs matplotlib) there
engine.reschedule_workload(profiler.get_metrics())  # every rank: re-plan from what it measured
