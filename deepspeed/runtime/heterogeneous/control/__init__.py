# SPDX-License-Identifier: Apache-2.0
"""The runtime controller's parts (the controller itself is the top-level ``runtime.py``, which
keeps the hooks, the phase machine and the collectives): what each training forward computes and
how its loss is weighted (``feeding``: the fed batch judged alike on every rank, the re-split of a
stock loader's batches and the outputs' return), and what rank 0 decides from the pooled
measurements (``decisions``: the plan after each profiling step, the checks, the plan changes, and
how a plan is printed).

May import every subpackage before it (config, measure, cluster, emulation, memory, planning, data,
comm, pipeline, integrations); no collective of its own except the feeding agreement
(``data.resplit.agree``) and the re-split's exchange.
"""
