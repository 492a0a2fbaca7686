# SPDX-License-Identifier: Apache-2.0
"""Single-process references that heterogeneous training must reproduce."""

import torch


def adam_mse_reference(model, inputs, targets, step_indices, lr):
    """Train ``model`` in one process with torch's Adam on MSE, step k on the samples
    ``step_indices[k]`` of ``inputs``/``targets``; returns its parameters."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for indices in step_indices:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs[indices]), targets[indices]).backward()
        optimizer.step()
    return list(model.parameters())
