# SPDX-License-Identifier: Apache-2.0
"""Single-process references that heterogeneous training must reproduce."""

import torch


def adam_mse_reference(model, inputs, targets, step_indices, lr, optimizer_class=None):
    """Train ``model`` in one process with torch's Adam (or ``optimizer_class``) on MSE, step k on
    the samples ``step_indices[k]`` of ``inputs``/``targets``; returns its parameters."""
    optimizer = (optimizer_class or torch.optim.Adam)(model.parameters(), lr=lr)
    for indices in step_indices:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[indices]), targets[indices]).backward()
        optimizer.step()
    return list(model.parameters())


def consecutive_batches(batch, steps):
    """Step k's sample indices when every step takes the next ``batch`` samples."""
    return [list(range(k * batch, (k + 1) * batch)) for k in range(steps)]


class RecordingDataset(torch.utils.data.Dataset):
    """``samples`` deterministic (input, target) pairs of width ``width`` drawn with ``seed``;
    records every index it hands out (``seen``), so a test can check what each rank was fed."""

    def __init__(self, samples, width, seed):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(samples, width, generator=generator)
        self.targets = torch.randn(samples, width, generator=generator)
        self.seen = []

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        self.seen.append(int(index))
        return self.inputs[index], self.targets[index]
