# SPDX-License-Identifier: Apache-2.0
"""Who computes how many samples: the ``Plan`` (``plan``), per-rank time models (``time_model``), the
load-balancing strategies (``strategies``: the built-in ones, registered), the integer split
(``integer_split``, ``allocation``), the planner, what profiling decides
(``profiling``) and the sizes its steps probe (``probe_sizes``), when dynamic rebalancing acts
(``rebalance``, ``statistics``), what re-splitting a stock loader's batches costs (``exchange``), the
pipeline's stage partition (``stages``) and the precision choice (``precision``).

Pure functions of measurements and settings: no collective, no torch.distributed.
May import: ``config``, ``measure``, ``memory``.
"""
