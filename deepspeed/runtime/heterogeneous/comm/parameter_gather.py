# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_config.communication.overlap_parameter_gather``: ZeRO-1/2's all-gather of the
updated parameters runs during the next forward instead of at the end of the step.

After each optimizer step upstream gathers every rank's updated partition (``all_gather_dp_groups``;
hierarchically here, ``HierarchicalReducer.all_gather_partitions``), and the step waits for all of
it: on 2 hosts x 2 ranks half the step's bytes on the slow link, exposed. Here the step hands the
gather to the overlap worker (``overlap.BackgroundReduction``, idle during the forward) and
returns; each module of the next forward waits, in a forward pre-hook, only for the part of the
gather its own parameters lie in.

The gather, as jobs the worker runs in order (``GatherPlan``):

- **local**: inside each host every member broadcasts its partitions (every group's), so each rank
  holds its host's block: the partitions of its host's members;
- **round r** (r = 0 .. R-1): the host leaders exchange the r-th chunk of each host's block
  (every group's chunk together, ``PIECES_PER_ROUND`` of the slowest link's pieces, through the
  reducer's all-to-all of the leaders: sent piece by piece, and coded where ``compress_inter_host``
  is ``"lossless"``), and each leader broadcasts what came to its host. Every host sends at once, so
  the links carry both directions as the synchronous all-to-all does, and each host's block
  crosses in flat order: the first layers a remote host needs come first.

Each element crosses each link once, as in the synchronous gather, and values are only copied:
the parameters are the same bits. A parameter is ready after job ``ready_index``: ``local`` when
it lies in this host's block, else the round of its last element in another host's block; a
module waits for the largest index of its own parameters (``torch.nn.Module`` forward pre-hooks,
registered once). The worker takes the gathers' jobs in the order every rank queues them, after
the reductions queued before, so each of the reducer's groups sees one sequence on every member.

Everything else that reads the parameters waits for the whole gather: the backward's start, any
module's ``state_dict`` and ``load_state_dict`` (checkpoints), the next step's gather and a gather
through the reducer on the main thread. Code that reads a parameter outside its module's forward between ``step()`` and
the next forward (a weight norm logged after the step, an EMA copy, a parent module reading a
child's weight without calling the child, ``offload_states``, a ``custom_load_fn``) must call
``engine.wait_for_parameters()`` first: hence opt-in, ``false`` by default. The main thread's own
collectives on the reducer's groups (a synchronous bucket, another gather) wait for the gather
first (``wait_for_reducer``), and a worker is replaced only after its gathers are done
(``detach_reducer``). Applies where the background reduction is in force for ZeRO-1/2
(``overlap``) and the parameter groups share one dtype.
"""

import bisect
import collections
import weakref

import torch

from deepspeed import comm as dist

DEFAULT_CHUNK_ELEMENTS = 1 << 18
"""The most elements of a host's block per round (1 MiB of fp32), and the round where the link
was not measured (the reducer sends whole messages then)."""

PIECES_PER_ROUND = 4
"""A round moves about this many of the reducer's pieces (``host_groups.piece_elements_for``: a
few ms of the slowest link each), fewer hand-overs between the worker and the forward than one
piece per round: on the 2 x 2 bench at 177 Mbit/s one quick repeat each gave the step x1.02 of
overlap's with rounds of one piece and x0.90-0.92 with 5 or 19; medians of 3 with 4 pieces
x0.91-1.00. Within a round the pieces travel one by one, as in every exchange of the leaders: sent
as one message, a round crossed a 60 Mbit/s link at 41 Mbit/s (50 ms for 257 KB each way), in pieces
at the link's rate (34 ms), which cut the forward's exposed wait from 185 ms to 61-85 ms
(``bench_overlap.py --dilation``)."""


def chunk_elements_for(piece_elements):
    """Elements of a host's block per round for the reducer's ``piece_elements`` (None: not measured)."""
    if not piece_elements:
        return DEFAULT_CHUNK_ELEMENTS
    return min(DEFAULT_CHUNK_ELEMENTS, PIECES_PER_ROUND * piece_elements)

ATTRIBUTE = "_heterogeneous_parameter_gather"
"""The optimizer's ``DeferredGather`` (absent: the gather runs in the step, upstream's place)."""

_live = weakref.WeakSet()
"""Every ``DeferredGather`` not removed (the gather's call site knows only the partitions)."""


class GatherPlan:
    """Which slices of which partitions each job of one deferred gather moves, and after which job
    each parameter is ready on this rank. Pure: built from sizes and the layout alone.

    Args:
        sizes: ``sizes[i][m]``: elements of member m's partition of parameter group i; partitions
            lie in member order in the group's flat buffer (upstream's ``get_data_parallel_partitions``).
        layout: the reducer's ``GroupLayout``.
        host: this rank's host.
        chunk_elements: elements of a host's block per round (all groups together).
    """

    def __init__(self, sizes, layout, host, chunk_elements):
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.layout, self.host = layout, host
        self.starts = [[sum(group[:m]) for m in range(len(group))] for group in sizes]
        block_sizes = [sum(sum(group[m] for m in members) for group in sizes) for members in layout.host_members]
        self.rounds = max(1, max(-(-size // chunk_elements) for size in block_sizes))
        # Host h's block of group i is its members' partitions, in member order; per round, each
        # group's block moves this many elements (every group's block spread over the rounds).
        self.per_round = [[max(1, -(-sum(group[m] for m in members) // self.rounds)) for members in layout.host_members]
                          for group in sizes]
        self.sizes = sizes

    def chunk(self, group, host, index):
        """``[(member, start, end)]``: the slices of the partitions of ``host``'s members in group
        ``group`` that round ``index`` moves (offsets within each partition)."""
        size = self.per_round[group][host]
        lo, hi = index * size, (index + 1) * size
        slices, offset = [], 0
        for member in self.layout.host_members[host]:
            numel = self.sizes[group][member]
            start, end = max(lo, offset), min(hi, offset + numel)
            if start < end:
                slices.append((member, start - offset, end - offset))
            offset += numel
        return slices

    def ready_index(self, group, start, end):
        """The job after which flat elements ``[start, end)`` of ``group`` are current on this rank:
        0 (``local``) or 1 + a round."""
        starts = self.starts[group]
        index = 0
        member = max(0, bisect.bisect_right(starts, start) - 1)
        while member < len(starts) and starts[member] < end:
            lo, hi = max(start, starts[member]), min(end, starts[member] + self.sizes[group][member])
            host = self.layout.host_of(member)
            if lo < hi and host != self.host:
                offset = sum(self.sizes[group][m] for m in self.layout.host_members[host] if m < member)
                index = max(index, 1 + (offset + hi - starts[member] - 1) // self.per_round[group][host])
            member += 1
        return index

    @property
    def jobs(self):
        return 1 + self.rounds


_Round = collections.namedtuple("_Round", "own received out_sizes largest")
"""One round on this rank (``DeferredGather._round_views``)."""


class _Gather:
    """One step's deferred gather: the worker's jobs, oldest first."""

    def __init__(self, jobs):
        self.jobs = jobs

    def wait(self, index):
        from .overlap import wait_for_job
        wait_for_job(self.jobs[min(index, len(self.jobs) - 1)], "parameter gather")


class DeferredGather:
    """ZeRO-1/2's parameter all-gather of one optimizer, run by ``background``'s worker during the
    next forward (see the module)."""

    def __init__(self, reducer, background, optimizer, module, chunk_elements=None):
        self.reducer, self.background = reducer, background
        self.pending = None  # _Gather while a gather's jobs may still be running
        self.partitions = optimizer.parallel_partitioned_bit16_groups
        flats = optimizer.bit16_groups_flat
        sizes = [[part.numel() for part in parts] for parts in self.partitions]
        for flat, parts in zip(flats, self.partitions):
            if parts[0].data_ptr() != flat.data_ptr() or any(
                    b.data_ptr() != a.data_ptr() + a.numel() * a.element_size() for a, b in zip(parts, parts[1:])):
                raise ValueError("the partitions are not consecutive slices of the flat parameter buffer")
        self.plan = GatherPlan(sizes, reducer.layout, reducer.host,
                               chunk_elements or chunk_elements_for(reducer.piece_elements))
        self._rounds, self._storage = None, None
        ready = {}
        for group, (flat, params) in enumerate(zip(flats, optimizer.bit16_groups)):
            base, size = flat.data_ptr(), flat.element_size()
            for param in params:
                start = (param.data_ptr() - base) // size
                ready[param] = self.plan.ready_index(group, start, start + param.numel())
        self.ready = ready
        self._hooks = []
        _live.add(self)
        whole = lambda *args, **kwargs: self.wait_all()  # noqa: E731
        for sub in module.modules():
            indices = [ready[p] for p in sub.parameters(recurse=False) if p in ready]
            if indices:
                # First among the module's pre-hooks: one that rebuilds a weight from its parameters
                # (weight_norm, pruning) must read the gathered values.
                self._hooks.append(sub.register_forward_pre_hook(self._pre_hook(max(indices)), prepend=True))
            # Reading or loading a state dict, of any module: the whole gather first (a load must
            # not race the worker's writes).
            self._hooks += [sub.register_state_dict_pre_hook(whole), sub.register_load_state_dict_pre_hook(whole)]

    def _pre_hook(self, index):
        def hook(module, args):
            if self.pending is not None:
                self.pending.wait(index)
        return hook

    def _round_views(self, index):
        """What round ``index`` moves on this rank, worked out once per buffer: this host's slices
        (every group's, in group order), the other hosts' slices it receives (in host order), the
        elements it receives from each host, and the most any host sends in the round (the same
        on every rank: it sets the exchange's pieces)."""
        layout, mine = self.reducer.layout, self.reducer.host
        per_host = [[self.partitions[group][member].narrow(0, start, end - start)
                     for group in range(len(self.partitions)) for member, start, end in self.plan.chunk(group, host, index)]
                    for host in range(layout.num_hosts)]
        own = per_host[mine]
        return _Round(own=own, received=[view for host, views in enumerate(per_host) if host != mine for view in views],
                      out_sizes=[0 if host == mine else sum(view.numel() for view in views)
                                 for host, views in enumerate(per_host)],
                      largest=max(sum(view.numel() for view in views) for views in per_host))

    # -- the main thread ------------------------------------------------------------------------

    def start(self):
        """Queue the gather of the current partitions (the step just wrote this rank's); returns at once."""
        from .overlap import _Job
        self.wait_all()
        storage = [parts[0].data_ptr() for parts in self.partitions]
        if storage != self._storage:  # first gather, or the buffers moved (offload_states, reload_states)
            self._rounds = [self._round_views(index) for index in range(self.plan.rounds)]
            self._storage = storage
        jobs = [_Job(None, None, run=self._local)] + [_Job(None, None, run=self._round(views)) for views in self._rounds]
        self.pending = _Gather(jobs)
        self.background.submit(jobs)

    def wait_all(self):
        """Every parameter current (a no-op when no gather is pending)."""
        pending = self.pending
        if pending is not None:
            pending.wait(len(pending.jobs) - 1)
            self.pending = None

    def remove(self):
        """Finish the pending gather and take the hooks off the module, also after the gather
        failed (its error was raised where it was waited for; an engine built anew must not meet
        it again)."""
        from .overlap import OverlapError
        try:
            self.wait_all()
        except OverlapError:
            self.pending = None
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks = []
            _live.discard(self)

    # -- the worker -----------------------------------------------------------------------------

    def _local(self):
        reducer = self.reducer
        if reducer.host_size == 1:
            return
        for parts in self.partitions:
            for member in reducer.layout.host_members[reducer.host]:
                dist.broadcast(parts[member], reducer.ranks[member], group=reducer.intra_group)

    def _round(self, views):
        def gather_round():
            reducer = self.reducer
            if reducer.is_leader:
                sent = torch.cat(views.own) if views.own else self.partitions[0][0].new_empty(0)
                sends = [sent.new_empty(0) if host == reducer.host else sent for host in range(reducer.layout.num_hosts)]
                arrived = torch.cat(reducer.leaders_all_to_all(sends, views.out_sizes, largest=views.largest))
            if not views.received:
                return
            if reducer.host_size > 1:
                if not reducer.is_leader:
                    arrived = views.received[0].new_empty(sum(view.numel() for view in views.received))
                dist.broadcast(arrived, reducer.leader, group=reducer.intra_group)
            offset = 0
            for view in views.received:
                view.copy_(arrived.narrow(0, offset, view.numel()))
                offset += view.numel()
        return gather_round


def decision(setting, reducer, optimizer, served=True, overlap_note=None):
    """``(active, note)``: whether ``optimizer``'s parameter gather is deferred to the next forward
    (``overlap_note``: why the gradient reduction is not overlapped, if it is not). Every input is the
    same on every rank. Raises ValueError naming the key where ``true`` cannot
    apply; without a reducer (one host) there is nothing to defer and ``true`` is no error."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if setting is False:
        return False, None
    why = None
    if reducer is None:
        why = "the hierarchical reduction is not in force (one host, or hierarchical_reduction false)"
    elif not isinstance(optimizer, DeepSpeedZeroOptimizer):
        why = "it defers ZeRO-1/2's parameter all-gather, and this run uses another optimizer or ZeRO stage"
    elif not served:
        why = "some parameter groups are gathered over a group the hierarchical reduction does not serve"
    elif reducer.background is None:
        why = ("the gradient reduction is not overlapped (communication.overlap" +
               (f": {overlap_note}" if overlap_note else "") + "), and its worker runs the gather")
    elif len({parts[0].dtype for parts in optimizer.parallel_partitioned_bit16_groups}) > 1:
        why = "the parameter groups differ in dtype"
    if why is None:
        return True, None
    if reducer is not None:
        raise ValueError(f"heterogeneous_config.communication.overlap_parameter_gather is true, but {why}; "
                         "set it false")
    return False, why


def attach(reducer, setting, optimizer, module, served=True, overlap_note=None):
    """Give ``optimizer`` a ``DeferredGather`` when ``decision`` says so, after removing an earlier
    one of the same optimizer. Returns the note of why not, or None."""
    detach(optimizer)
    active, note = decision(setting, reducer, optimizer, served, overlap_note)
    if active:
        setattr(optimizer, ATTRIBUTE, DeferredGather(reducer, reducer.background, optimizer, module))
    return note


def deferred(optimizer):
    """The optimizer's ``DeferredGather``, or None."""
    return getattr(optimizer, ATTRIBUTE, None)


def detach(optimizer):
    """Finish ``optimizer``'s pending gather and remove its hooks."""
    gather = getattr(optimizer, ATTRIBUTE, None) if optimizer is not None else None
    if gather is not None:
        gather.remove()
        delattr(optimizer, ATTRIBUTE)


def detach_reducer(reducer):
    """Before ``reducer``'s overlap worker is replaced or stopped: finish and remove every gather
    that runs on it (its jobs would never run on a closed worker), also one whose optimizer is gone."""
    for gather in list(_live):
        if gather.reducer is reducer:
            gather.remove()
    background = getattr(reducer, "background", None)
    optimizer = background.optimizer() if background is not None else None
    if optimizer is not None and hasattr(optimizer, ATTRIBUTE):
        delattr(optimizer, ATTRIBUTE)


def wait_for_reducer(reducer):
    """Before the main thread runs a collective on ``reducer``'s groups: finish the gathers queued
    on its worker, so that each group keeps one sequence on every member."""
    for gather in list(_live):
        if gather.reducer is reducer:
            gather.wait_all()


def started(partitions):
    """At ZeRO-1/2's gather after the step: True when the gather of ``partitions``
    (``parallel_partitioned_bit16_groups``) was handed to the worker, False to gather now."""
    for gather in list(_live):
        if gather.partitions is partitions:
            gather.start()
            return True
    return False


def wait_for(partitions):
    """Before a synchronous gather of ``partitions``: finish a deferred one."""
    for gather in list(_live):
        if gather.partitions is partitions:
            gather.wait_all()


def wait_all(optimizer):
    """Every parameter of ``optimizer`` current: a no-op without a deferred gather pending."""
    gather = getattr(optimizer, ATTRIBUTE, None)
    if gather is not None:
        gather.wait_all()
