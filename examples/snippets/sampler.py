# SPDX-License-Identifier: Apache-2.0
"""Your own DataLoader fed by the heterogeneous sampler.

    deepspeed --num_gpus 2 examples/snippets/sampler.py
"""

import torch

import deepspeed

model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
dataset = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
engine, _, _, _ = deepspeed.initialize(model=model, config_params={
    "train_batch_size": 32,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "torch_adam": True}},
    "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": [20, 12]},
})
# This rank's planned micro-batches; registered with the engine, so plan changes reach the loader.
sampler = engine.heterogeneous_sampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)   # no workers: changes apply at the next step
for epoch in range(2):
    sampler.set_epoch(epoch)
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
print(f"rank {engine.heterogeneous_state.dp_rank}: {len(inputs)} samples per micro-step, loss {loss.item():.4f}")
