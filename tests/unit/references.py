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
