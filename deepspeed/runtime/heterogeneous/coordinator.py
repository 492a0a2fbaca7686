# SPDX-License-Identifier: Apache-2.0
"""The start-up coordinator: the one place the fork's start-up collectives run.

Building a ``DeepSpeedConfig`` only parses (``HeterogeneousState.from_config``): the fork's blocks
are validated and recorded, nothing is gathered, and the batch fields hold the even split until
the plan replaces them. What needs the other ranks is done here, once per config, by whoever is
about to use the config for real, in step on every rank:

- the engine, first thing as it starts (``HeterogeneousState.engine_starting``);
- ``deepspeed.zero.Init``, whose parameters take their dtype from the config's precision
  (``zero3-uneven-shards.patch``; transformers builds a ZeRO-3 model under it before the engine).

``coordinate`` checks that every rank runs the same settings (through the rendezvous store, before
any collective), gathers the devices, probes the topology, then settles what depends on them in a
fresh copy of the parsed dict (the precision, adaptive chunking's and the links' bucket sizes, the
ZeRO-3 settings) and has upstream derive its fields from that copy again, the batch fields from the
start-up plan included, planned once per process (``HeterogeneousState.startup_plans``).

What the collectives found is kept for the process (``ClusterFacts``): a second config of the same
settings on the same process group (``zero.Init`` and then the engine, or a second engine) takes
them from there, so a rank that coordinates one more config than its peers issues no collective.
"""

import copy
import json
import logging
import os
import warnings
import weakref

from deepspeed.utils import logger

from .config.errors import one_line_config_errors
from .config.settings import HeterogeneousConfigError, settings_summary


class ClusterFacts:
    """What the start-up collectives found, for this process: by (settings, data-parallel rank,
    world size, process group), the devices, the topology and the start-up plans made from them.

    The process group is told by its generation: one more each time a default group other than the
    last one seen turns up (a job that destroys its group and builds another asks again). Not by
    ``id()``: CPython may give a destroyed group's address to the next one on some ranks and not on
    others, and those would skip the collectives their peers run. Only what every rank has alike
    may decide whether the collectives run."""

    def __init__(self):
        self._facts = {}
        self._default_group = None  # a weak reference to the default group seen last
        self._generation = 0

    def key(self, summary, dp_rank, world_size):
        from deepspeed import comm as dist
        group = None
        if dist.is_initialized():
            from torch.distributed import distributed_c10d
            current = distributed_c10d._get_default_group()
            if self._default_group is None or self._default_group() is not current:
                self._default_group = weakref.ref(current)
                self._generation += 1
            group = (dist.get_rank(), dist.get_world_size(), self._generation)
        return json.dumps(summary, sort_keys=True, default=str), int(dp_rank), int(world_size), group

    def get(self, key):
        return self._facts.get(key)

    def put(self, key, facts):
        self._facts[key] = facts

    def clear(self):
        """Forget every process group's facts (the test harness runs cases that are jobs of their
        own, on other emulated devices, in one process)."""
        self._facts.clear()


facts = ClusterFacts()
"""This process's cache of the start-up collectives' results (a process's devices do not change
under it)."""


def coordinate(ds_config):
    """Run the fork's start-up for ``ds_config`` (a ``DeepSpeedConfig`` with the fork on) on every
    rank: agree, gather, probe, plan, and settle the config's derived fields. Once per config;
    nothing when the fork is off."""
    state = ds_config.heterogeneous
    if not state.enabled or state.coordinated:
        return
    quiet_repeated_warnings()
    found = _cluster_facts(state, ds_config)
    state.devices, state.topology, state.startup_plans = found
    processed = copy.copy(state.param_dict)
    _settle_config(state, processed)
    state.coordinated = True
    # Upstream's fields again, from the settled copy; its warnings about the user's keys were given
    # when the config was built.
    with _quiet_config_warnings():
        ds_config._initialize_params(processed)
    ds_config._configure_train_batch_size()  # the start-up plan's batch fields (state.configure)
    ds_config._do_error_check()


def _cluster_facts(state, ds_config):
    """(devices, topology, start-up plans): gathered on every rank, or this process's earlier ones."""
    from deepspeed.accelerator import get_accelerator
    from .cluster.agreement import check_settings_agree
    from .cluster.ranks import (ACCELERATE_PROCESSES, accelerate_process_count, accelerate_world_problem,
                                gather_local_devices)
    from .cluster.topology import discover_topology
    world_size = int(ds_config.world_size)
    summary = settings_summary(state.settings)
    processes = accelerate_process_count()
    if processes is not None:  # compared as a setting: every rank must have been set up alike
        summary["settings"][ACCELERATE_PROCESSES] = processes
    key = facts.key(summary, state.dp_rank, world_size)
    if facts.get(key) is None:
        # Before the fork's first collective: a rank whose environment or config differs, or that
        # runs without the fork, ends here with an error naming it rather than in a hang.
        check_settings_agree(summary)
        # Agreed above, so every rank raises alike.
        error, problem = accelerate_world_problem(processes, _job_world_size(), get_accelerator().device_name(),
                                                  state.param_dict)
        if error:
            one_line_config_errors()
            raise HeterogeneousConfigError(problem)
        if problem and _job_rank() == 0:
            logger.warning(problem)
        devices = gather_local_devices(state.settings, state.dp_rank, world_size, state.emulated_rank)
        facts.put(key, (devices, discover_topology(state.dp_rank, world_size), {}))
    return facts.get(key)


def _settle_config(state, param_dict):
    """Write what the devices and links decide into ``param_dict`` (the parsed dict's copy; the
    blocks it changes are copied too): the precision, adaptive chunking's and the links' bucket
    sizes, the ZeRO-3 settings."""
    from .comm.link_buckets import keys_set_by_user
    from .memory.zero3_settings import configure_zero3_settings
    from .planning.precision import choose_precision_for_config
    from .startup import configure_link_buckets
    state.precision = choose_precision_for_config(state.settings.config.mixed_precision_support, state.devices,
                                                  param_dict)
    user_zero = keys_set_by_user(param_dict)  # before the fork writes sizes into the zero block
    if state.settings.memory.enabled and state.settings.memory.adaptive_chunking:
        from .memory.chunking import apply_adaptive_chunking
        from .memory.pool import memory_capacities
        state.chunk_sizes = apply_adaptive_chunking(param_dict, memory_capacities(state))
    state.link_bucket_sizes = configure_link_buckets(state, param_dict, user_zero)
    configure_zero3_settings(state, param_dict, user_zero)  # ZeRO-3: fewer collectives per step
    if state.settings.memory.enabled and state.settings.memory.zero_partitions == "auto":
        from .memory.pool import init_prior_shares
        state.init_shares = init_prior_shares(state, len(state.devices or ()))  # zero.Init's cut of "auto"


class _ConfigModuleFilter(logging.Filter):

    def filter(self, record):
        return not (record.levelno <= logging.WARNING and os.path.basename(record.pathname).startswith("config"))


class _quiet_config_warnings:
    """While upstream parses the settled copy: its config modules' warnings (deprecated keys ...)
    were shown when the config was built from the same keys."""

    def __enter__(self):
        self._filter = _ConfigModuleFilter()
        logger.addFilter(self._filter)

    def __exit__(self, *exc):
        logger.removeFilter(self._filter)


def quiet_repeated_warnings(environ=None):
    """Torch's deprecation warnings about the collectives upstream calls
    (```torch.distributed.<name>` is deprecated ...``) are shown by global rank 0 alone: every rank
    would print the same line, about code the user cannot change. (TorchBackend already calls
    all_gather_single and reduce_scatter_single, not the names torch 2.13 deprecates.)"""
    environ = os.environ if environ is None else environ
    if environ.get("RANK", "0") != "0":
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _job_world_size():
    from deepspeed import comm as dist
    return dist.get_world_size() if dist.is_initialized() else 1


def _job_rank():
    from deepspeed import comm as dist
    return dist.get_rank() if dist.is_initialized() else 0
