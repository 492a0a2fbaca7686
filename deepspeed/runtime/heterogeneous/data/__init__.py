# SPDX-License-Identifier: Apache-2.0
"""Feeding each rank its planned share: the heterogeneous batch sampler and its epoch split
(``sampler``, ``epoch_split``), the engine's loader (``loader``), the check that what a rank
was fed matches the plan (``fed_batch``), the re-split of a stock loader's batches to the plan
(``resplit``; a batch's tensors as it sees them: ``batch_structure``) and what it costs (``exchange_account``), and the item counts of a loss that is a mean over items (``loss_items``).

May import: ``config``, ``measure``, ``planning``.
"""
