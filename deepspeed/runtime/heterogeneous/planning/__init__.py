# SPDX-License-Identifier: Apache-2.0
"""Who computes how many samples: the ``Plan``, per-rank time models (``time_model``), the
integer split (``integer_split``, ``allocation``), the planner, what profiling decides
(``profiling``), when dynamic rebalancing acts (``rebalance``, ``statistics``) and the precision
choice (``precision``).

Pure functions of measurements and settings: no collective, no torch.distributed.
May import: ``config``, ``measure``, ``memory``.
"""
