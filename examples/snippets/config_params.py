# SPDX-License-Identifier: Apache-2.0
"""The fork's blocks passed as a dict: deepspeed.initialize(model=model, config_params={...}).

    deepspeed --num_gpus 2 examples/snippets/config_params.py
    python examples/snippets/config_params.py      # one process, no launcher needed
"""

import torch

import deepspeed

model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
engine, optimizer, _, _ = deepspeed.initialize(model=model, config_params={
    "train_batch_size": 32,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
    "zero_optimization": {"stage": 2},
    "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware",
                             "mixed_precision_support": "fp32", "profile_steps": 3},
    "heterogeneous_memory": {"enabled": True, "hbm_utilization_threshold": 0.85, "cpu_memory_limit": "64GB"},
})
for step in range(5):
    mbs = engine.train_micro_batch_size_per_gpu()   # this rank's share now: profiling changes it
    inputs, targets = torch.randn(mbs, 16), torch.randn(mbs, 1)
    loss = torch.nn.functional.mse_loss(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
print(f"rank {engine.global_rank}: plan {engine.heterogeneous_plan.micro_batch_sizes}, loss {loss.item():.4f}")
