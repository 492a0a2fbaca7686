# SPDX-License-Identifier: Apache-2.0
"""Runs whose devices change: loading a checkpoint onto another world (``resize``: the optimizer
state re-partitioned through upstream's universal checkpoint, converted in-process by global rank 0)
and checkpoints the engine takes by itself at step boundaries (``periodic``), so that a run
restarted on the surviving devices loses little.

May import the subpackages before it (config, measure, cluster, emulation, memory, planning, data,
comm, pipeline, integrations, control); its collectives go through ``cluster.agreement`` and every
branch that shapes one is taken from gathered facts.
"""
