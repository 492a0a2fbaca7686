# SPDX-License-Identifier: Apache-2.0
"""Losses that are a mean over valid items (tokens, pixels), made exact for any split (pure).

The plan's loss weight ``W * n_r / sum(n)`` counts samples: it turns every rank's mean over its
own rows into the mean over the global batch's rows. A loss that is a mean over *items* (tokens
whose label is not ``ignore_index``, the pixels of a mask) has a row count that is not its
denominator: the ranks' token means, weighted by rows, are not the global token mean (upstream's
equal split has the same error). Weighted by items instead,

    w_r = W * items_r / sum(items)

every upstream reducer's average of ``w_r * mean_r`` is ``sum(item losses) / sum(items)``: the mean
over every item of the round, whatever the split. The engine counts ``items_r`` where the loss's
input is (``heterogeneous_config.loss_items``, or the Trainer integration) and sums them over the
ranks, one collective per training forward (``runtime.py``).
"""

__all__ = ["count_items", "items_weight", "select_input"]


def select_input(inputs, kwargs, name):
    """The forward argument ``name``: a keyword's name, or a positional index (int); None when the
    call has no such argument."""
    if isinstance(name, int):
        return inputs[name] if 0 <= name < len(inputs) else None
    return (kwargs or {}).get(name)


def count_items(value, ignore_index=-100, shift=False):
    """Items of ``value`` (a tensor) that are not ``ignore_index``; with ``shift`` the first position
    of the last dimension is left out (a causal LM's shifted labels predict positions 1..T-1).
    A boolean or 0/1 mask with ``ignore_index`` 0 counts its set elements."""
    if shift:
        value = value[..., 1:]
    return int(value.ne(ignore_index).sum().item())


def items_weight(world_size, items, total, fallback):
    """``world_size * items / total``: this rank's loss weight when every rank's loss is a mean over
    its ``items`` and ``total`` is their sum over the ranks (``world_size`` processes, each counted
    once). ``fallback`` when no rank has an item: every loss is then over nothing, and a weight of
    zero would turn torch's NaN mean of nothing into NaN gradients."""
    if total <= 0:
        return fallback
    return world_size * items / total
