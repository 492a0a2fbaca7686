# SPDX-License-Identifier: Apache-2.0
"""Your own DataLoader fed by the heterogeneous sampler.

    deepspeed --num_gpus 2 examples/snippets/sampler.py
"""

import torch

import deepspeed
from deepspeed.runtime.heterogeneous.sampler import HeterogeneousBatchSampler

model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
dataset = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
engine, _, _, _ = deepspeed.initialize(model=model, config_params={
    "train_batch_size": 32,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
    "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": [20, 12]},
})
plan = engine.heterogeneous_plan
dp_rank = engine.heterogeneous_state.dp_rank
sampler = HeterogeneousBatchSampler(dataset, list(plan.micro_batch_sizes), rank=dp_rank, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)   # num_workers=0 follows plan changes at once
for epoch in range(2):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
print(f"rank {dp_rank}: {len(inputs)} samples per micro-step, loss {loss.item():.4f}")
