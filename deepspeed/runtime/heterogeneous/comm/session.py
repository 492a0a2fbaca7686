# SPDX-License-Identifier: Apache-2.0
"""``CommunicationSession``: everything one engine's communication starts, and the one owner that ends it.

An engine on several hosts may run a hierarchical reducer (``hierarchical.py``) with the process
groups it creates, an overlap worker thread on those groups (``overlap.py``), a deferred parameter
gather (``parameter_gather.py``), host shards with hooks on the ZeRO-3 parameters
(``host_shards.py``), or a low-communication replica per host (``low_communication.py``). The
session holds them for the engine's life:

- ``CommunicationSession.open(engine)`` (the engine, once its optimizer is built:
  ``comm-hierarchical-reduction.patch``): decides from the agreed settings, the hosts and the agreed offload set
  (the same on every rank, so every rank creates the same groups or none), registers the reducer
  for the data-parallel group (upstream's call sites find it with ``hierarchical.reducer_for``),
  and checks with one agreement that every rank decided the features alike. An earlier engine's
  session on the same group is closed first (or hands its reducer over when the groups are the
  same: no second creation).
- ``close()`` (``engine.destroy()``, a new engine on the group, a refused start): the worker joined
  (``overlap.CLOSE_TIMEOUT_S``; one that does not end is named in an error), a deferred gather
  finished, the host shards' hooks removed, the reducer unregistered and the groups it created
  destroyed. Idempotent; every rank closes alike.

The engine keeps its session as ``state.comm_session``.
"""

import weakref

from deepspeed import comm as dist
from deepspeed.utils import logger

from . import hierarchical, host_shards, overlap, parameter_gather
from .host_groups import agree_on_features, group_layout, piece_elements_for, reduction_decision
from .status import reduction_line

_sessions = {}
"""Data-parallel process group -> the open CommunicationSession of the engine that uses it."""


def engine_hosts(state, world_size):
    """The host of each data-parallel rank from the fork's discovered topology
    (``cluster/topology.py``: the launcher's node rank, which an emulation sets per host), else None
    (one host)."""
    topology = getattr(state, "topology", None)
    return None if topology is None else tuple(topology.hosts)


class CommunicationSession:
    """One engine's communication (module docstring). ``reducer``: the hierarchical reducer in force,
    or None (flat upstream collectives, or a low-communication replica)."""

    def __init__(self, engine, group):
        # A weak reference: the registry must not keep an engine the user dropped alive.
        self._engine = weakref.ref(engine)
        self.group = group
        self.reducer = None
        self.host_shards = None
        self.closed = False

    @property
    def engine(self):
        return self._engine()

    @classmethod
    def open(cls, engine):
        state = engine._config.heterogeneous
        group = engine.seq_data_parallel_group
        session = cls(engine, group)
        previous = _sessions.pop(group, None)
        inherited = previous.hand_over() if previous is not None else None
        try:
            session._start(state, inherited)
        except BaseException:
            if inherited is not None and inherited is not session.reducer:
                _close_reducer(inherited)
            session.close()
            raise
        if not state.enabled:  # the fork off: nothing to own, nothing registered (upstream's engine)
            session.closed = True
            return session
        _sessions[group] = session
        state.comm_session = session
        return session

    def hand_over(self):
        """Close this session but keep its reducer (and the groups it created) for the next engine on
        the same group, which adopts or closes it: its worker stopped, its gather finished."""
        reducer, self.reducer = self.reducer, None
        self.close()
        if reducer is not None:
            hierarchical._reducers.pop(self.group, None)
            overlap.attach(reducer, False, None)  # the worker joined before the settings change
            parameter_gather.detach_reducer(reducer)
        return reducer

    def _start(self, state, inherited):
        engine = self.engine
        if not state.enabled:
            _close_reducer(inherited)
            host_shards.attach(engine, None, False)  # parameters an earlier engine gave host shards gather flat
            return
        if state.low_communication is not None:  # each host a replica: nothing is reduced between hosts
            _close_reducer(inherited)
            state.low_communication.attach(engine)
            return
        group = self.group
        world_size = dist.get_world_size(group=group)
        hosts = engine_hosts(state, world_size)
        communication = state.settings.config.communication
        active, note = reduction_decision(communication.hierarchical_reduction, True, hosts,
                                          world_size == dist.get_world_size())
        if not active:
            if note and (communication.hierarchical_reduction is True or communication.compress_inter_host):
                logger.warning(f"heterogeneous_config.communication: hierarchical reduction not in force: {note}")
            _close_reducer(inherited)
            host_shards.attach(engine, None, False)
            _predict_overlap(state, False)
            return
        pieces = piece_elements_for(state.topology.link_bandwidth if state.topology is not None else None)
        if inherited is not None and inherited.layout == group_layout(hosts):
            reducer = inherited  # the same groups again: no second creation
            reducer.set_compression(communication.compress_inter_host)
            reducer.piece_elements = pieces
        else:
            _close_reducer(inherited)  # its groups are not this engine's
            reducer = hierarchical.HierarchicalReducer(hosts, group=group, compress=communication.compress_inter_host,
                                                       piece_elements=pieces)
        self.reducer = reducer
        hierarchical._reducers[group] = reducer

        def serves(partition_group):
            return hierarchical.zero3_reducer(partition_group) is reducer

        try:
            overlap_note = overlap.attach(reducer, communication.overlap, engine.optimizer, serves=serves,
                                          offloaded_ranks=state.offloaded_ranks)
            served = all(hierarchical._reducers.get(g) is reducer
                         for g in getattr(engine.optimizer, "real_dp_process_group", ()))
            parameter_gather.attach(reducer, communication.overlap_parameter_gather, engine.optimizer, engine.module,
                                    served, overlap_note)
            self.host_shards, shards_note = host_shards.attach(engine, reducer, communication.zero3_host_shards,
                                                               serves=serves)
        except ValueError as exc:  # `true` where it cannot apply: every rank decided alike, rank 0 says it once
            from ..config.errors import one_line_config_errors
            from ..config.settings import HeterogeneousConfigError
            one_line_config_errors()
            raise HeterogeneousConfigError(str(exc)) from None
        _predict_overlap(state, reducer.background is not None)
        agree_on_features(state.dp_rank, (reducer.background is not None,
                                          parameter_gather.deferred(engine.optimizer) is not None,
                                          self.host_shards is not None))
        if dist.get_rank() == 0:
            print(reduction_line(reducer, engine, communication, self.host_shards, shards_note, overlap_note,
                                 parameter_gather.deferred(engine.optimizer) is not None), flush=True)

    def close(self):
        """End what the session started (module docstring); a second call finds nothing left."""
        if self.closed:
            return
        self.closed = True
        if _sessions.get(self.group) is self:
            del _sessions[self.group]
        engine = self.engine
        state = None if engine is None else engine._config.heterogeneous
        if state is not None and getattr(state, "comm_session", None) is self:
            state.comm_session = None
        reducer, self.reducer = self.reducer, None
        try:
            if reducer is not None and hierarchical._reducers.get(self.group) is reducer:
                del hierarchical._reducers[self.group]
            _close_reducer(reducer)
        finally:
            # Parameters given host shards gather flat again (their hooks removed).
            if state is not None and state.enabled and engine.zero_optimization_stage() == 3:
                host_shards.attach(engine, None, False)
            self.host_shards = None


def _predict_overlap(state, active):
    """The memory pool counted the overlap worker's buckets where overlap might be in force
    (``overlap.expected``); once the engine decided against it, its predictions leave them out."""
    pool = getattr(state, "memory_pool", None)
    if not active and pool is not None:
        pool.revise_allocations(overlap_buckets=0)


def _close_reducer(reducer):
    if reducer is not None:
        reducer.close()  # its worker joined, its deferred gather finished, its groups destroyed


def close_engine_session(engine):
    """``engine.destroy()``: close the engine's session (none where the engine opened none)."""
    session = getattr(engine._config.heterogeneous, "comm_session", None)
    if session is not None and session.engine is engine:
        session.close()
    elif engine._config.heterogeneous.enabled and engine.zero_optimization_stage() == 3:
        host_shards.attach(engine, None, False)
