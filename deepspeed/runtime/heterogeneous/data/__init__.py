# SPDX-License-Identifier: Apache-2.0
"""Feeding each rank its planned share: the heterogeneous batch sampler and its epoch split
(``sampler``, ``epoch_split``), the engine's loader (``loader``) and the check that what a rank
was fed matches the plan (``fed_batch``).

May import: ``config``, ``measure``, ``planning``.
"""
