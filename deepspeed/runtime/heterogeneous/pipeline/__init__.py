# SPDX-License-Identifier: Apache-2.0
"""Heterogeneous pipelines: a ``PipelineModule(partition_method="heterogeneous")`` cut into stages
by measured layer costs and stage speeds as the engine starts, with the replicas' plan
(``build``), and checkpoints whose layer states load into another cut (``checkpoint``).

May import: ``config``, ``measure``, ``cluster``, ``planning``.
"""
