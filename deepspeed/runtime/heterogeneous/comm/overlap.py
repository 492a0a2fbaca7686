# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_config.communication.overlap``: ZeRO-1/2's hierarchical gradient reduction runs
in a background thread while the backward pass goes on (docs/multihost.md, "Overlap").

On a GPU upstream overlaps a full bucket's reduction with the backward through a side stream; the
CPU accelerator has no streams, so with gloo every full bucket stops the backward until its
reduction (in-host reduce, the leaders' exchange, the hand-back) is done, and on a slow link
between hosts that is most of the step. Here a full bucket is reduced by one worker thread per
process while the main thread computes the next buckets' gradients; the step waits only for what
is still on the wire when the backward ends.

How, without touching upstream's bookkeeping (every step below is on the main thread except the
worker's collectives):

1. **Capture** (``bucket_full``, instead of upstream's ``reduce_ipg_grads`` when a bucket is full):
   upstream's own ``average_tensor`` runs on a copy of the bucket with the reducer in capture mode,
   so that each ``reduce_to_owners(tensor, segments)`` it reaches is queued, not run. The full
   bucket object is set aside, intact (its gradients are views of its buffer), and the optimizer
   gets a fresh bucket to fill.
2. **Background**: the worker runs the queued reductions strictly in order, each exactly as the
   synchronous path would (``HierarchicalReducer.reduce_to_owners``). Every rank's worker takes the
   buckets in the same order and only the worker uses the reducer's groups while buckets are
   pending, so each group sees the same sequence of collectives on every member.
3. **Replay** (at a later full bucket when ``DEPTH`` buckets are pending, and in ``drain`` at the
   backward's end, before upstream reduces the last, partial bucket): the set-aside bucket is put
   back and upstream's unchanged ``reduce_ipg_grads`` runs with the reducer in replay mode. Each
   ``reduce_to_owners`` call it makes is checked against the captured one (same size, same
   owners) and receives the worker's result; upstream's tail (copying each rank's slices into its
   gradient partition, clearing the others) runs as before, in the same order.

The replayed values are the bits the synchronous path computes from the same inputs (the same
division, flattening and reduction), so overlap on and off give bitwise-equal parameters
(tests/unit/heterogeneous/test_overlap.py). Time dilation (``emulation``) stretches the compute
before a bucket is handed to the worker, as a slower device would produce it later.

Where the capture could not be exact the reduction stays synchronous, decided once from the
optimizer and the same on every rank (``overlap_decision``): reduce_scatter false, no contiguous
gradients, reduce-to-one-rank buckets (``use_multi_rank_bucket_allreduce`` false), MoE, ZeroFlow,
Muon, CPU offload, fp32 accumulation of bf16 gradients (the compact partition buffer) and
parameters larger than a bucket.
"""

import collections
import queue
import threading

import torch

from ..measure import comm_clock

DEPTH = 3
"""Buckets reduced in the background at once: the most buckets set aside (each holds a bucket's
gradients in its own buffer, ``reduce_bucket_size`` elements), and how far the backward runs ahead
of the link before it waits for the oldest."""


class OverlapError(RuntimeError):
    """The background reduction failed, or upstream's replay asked for another reduction than the
    one captured (a change in upstream's bucket slicing)."""


def overlap_decision(setting, reducer, optimizer):
    """Whether full ZeRO-1/2 buckets are reduced in the background, and a note saying why not.

    Args:
        setting: ``communication.overlap`` (True, False or "auto").
        reducer: the ``HierarchicalReducer`` in force for the optimizer's group, or None.
        optimizer: the ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``), or anything else.

    Every input is the same on every rank (the agreed settings, the model, the config), so every
    rank decides alike. Raises ValueError naming the key when ``true`` cannot apply to the
    optimizer; without the hierarchical reduction (one host, as for ``hierarchical_reduction:
    true``) there is nothing to overlap and ``true`` is not an error."""
    if setting is False:
        return False, None
    why = _why_not(reducer, optimizer)
    if why is None:
        return True, None
    if setting is True and reducer is not None:
        raise ValueError(f"heterogeneous_config.communication.overlap is true, but {why}; use \"auto\" (overlap "
                         "where it applies) or false")
    return False, why


def _why_not(reducer, optimizer):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    if reducer is None:
        return "the hierarchical reduction is not in force (one host, or hierarchical_reduction false)"
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "it overlaps ZeRO-1/2's gradient buckets, and this run uses another optimizer (ZeRO-0, ZeRO-3, BF16)"
    checks = [
        (not optimizer.reduce_scatter, "zero_optimization.reduce_scatter is false"),
        (not optimizer.contiguous_gradients, "zero_optimization.contiguous_gradients is false"),
        (not optimizer.use_multi_rank_bucket_allreduce, "use_multi_rank_bucket_allreduce is false"),
        (optimizer.cpu_offload, "the optimizer state is offloaded to the CPU"),
        (getattr(optimizer, "zenflow", False), "ZenFlow is on"),
        (getattr(optimizer, "has_moe_layers", False), "the model has MoE layers"),
        (_uses_muon(optimizer), "the optimizer is Muon"),
        (any(optimizer._use_compact_grad_partition_buffer(i) for i in range(len(optimizer.bit16_groups))),
         "gradients accumulate in fp32 (the compact partition buffer)"),
        (any(p.numel() > optimizer.reduce_bucket_size for group in optimizer.bit16_groups for p in group),
         "a parameter is larger than reduce_bucket_size"),
    ]
    return next((why for failed, why in checks if failed), None)


def _uses_muon(optimizer):
    inner = getattr(optimizer, "optimizer", None)
    return type(inner).__name__ == "MuonWithAuxAdam"


class _Job:
    __slots__ = ("tensor", "segments", "done", "error")

    def __init__(self, tensor, segments):
        self.tensor, self.segments = tensor, segments
        self.done = threading.Event()
        self.error = None


class BackgroundReduction:
    """One optimizer's buckets reduced by one worker thread through ``reducer`` (see the module)."""

    def __init__(self, reducer, depth=DEPTH):
        self.reducer = reducer
        self.depth = depth
        self.mode = None  # "capture" | "replay" | None: what hierarchical.all_reduce does with owners
        self.pending = collections.deque()  # (dtype, bucket, jobs), oldest first
        self._captured = None
        self._replaying = None
        self._spare = {}  # dtype -> buckets whose buffers may be filled again
        self._queue = queue.SimpleQueue()
        self._failure = None
        self._thread = threading.Thread(target=self._work, name="deepspeed-hetero-overlap", daemon=True)
        self._thread.start()

    # -- the worker ---------------------------------------------------------------------------

    def _work(self):
        comm_clock.mark_background_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._failure is None:
                try:
                    self.reducer.reduce_to_owners(job.tensor, job.segments)
                except BaseException as exc:  # noqa: BLE001 -- surfaced on the main thread at replay
                    self._failure = exc
            job.error = self._failure
            job.done.set()

    def close(self):
        """Stop the worker once it has run what is queued (the reducer is replaced or dropped)."""
        self._queue.put(None)

    # -- the main thread ----------------------------------------------------------------------

    def bucket_full(self, optimizer, dtype):
        """Set the full bucket of ``dtype`` aside and have its reduction run in the background;
        ``optimizer.ipg_buckets[dtype]`` is then a fresh bucket."""
        if len(self.pending) >= self.depth:
            self._replay_oldest(optimizer)
        bucket = optimizer.ipg_buckets[dtype]
        copy = bucket.buffer[bucket.index].narrow(0, 0, bucket.elements).clone()
        self._captured, self.mode = [], "capture"
        try:
            optimizer.average_tensor(copy, dtype)
            jobs = self._captured
        finally:
            self._captured, self.mode = None, None
        if not jobs:
            raise OverlapError("deepspeed-hetero: capturing a full gradient bucket reached no hierarchical reduction; "
                               "set heterogeneous_config.communication.overlap false")
        if comm_clock.enabled and comm_clock.before_collective is not None:
            comm_clock.before_collective()  # time dilation: a slower device hands the bucket over later
        for job in jobs:
            self._queue.put(job)
        self.pending.append((dtype, bucket, jobs))
        optimizer.ipg_buckets[dtype] = self._fresh(bucket, dtype)

    def drain(self, optimizer):
        """Wait for every bucket in the background and let upstream finish each (the backward is
        over, or a bucket is reduced synchronously next)."""
        while self.pending:
            self._replay_oldest(optimizer)

    def intercept(self, tensor, segments):
        """``hierarchical.all_reduce(tensor, owners=segments)`` while capturing or replaying."""
        if self.mode == "capture":
            self._captured.append(_Job(tensor, list(segments)))
            return
        job = self._replaying.popleft() if self._replaying else None
        if job is None or job.tensor.numel() != tensor.numel() or job.tensor.dtype != tensor.dtype \
                or job.segments != list(segments):
            raise OverlapError("deepspeed-hetero: the replayed gradient reduction differs from the captured one "
                               f"({tensor.numel()} elements, {len(segments)} slices); set "
                               "heterogeneous_config.communication.overlap false")
        self._wait(job)
        tensor.copy_(job.tensor)

    def _wait(self, job):
        if not job.done.is_set():
            comm_clock.enter()  # the step waits for the link: exposed communication
            try:
                job.done.wait()
            finally:
                comm_clock.leave()
        if job.error is not None:
            raise OverlapError(f"deepspeed-hetero: the background gradient reduction failed: {job.error}") \
                from job.error

    def _replay_oldest(self, optimizer):
        dtype, bucket, jobs = self.pending.popleft()
        current = optimizer.ipg_buckets[dtype]
        optimizer.ipg_buckets[dtype] = bucket
        self._replaying, self.mode = collections.deque(jobs), "replay"
        try:
            optimizer.reduce_ipg_grads(comm_dtype=dtype)
            if self._replaying:
                raise OverlapError(f"deepspeed-hetero: upstream's replay of a gradient bucket made "
                                   f"{len(jobs) - len(self._replaying)} of its {len(jobs)} reductions")
        finally:
            self._replaying, self.mode = None, None
            optimizer.ipg_buckets[dtype] = current
        self._spare.setdefault(dtype, []).append(bucket)  # upstream's tail cleared it

    def _fresh(self, full, dtype):
        spare = self._spare.get(dtype)
        if spare:
            return spare.pop()
        bucket = type(full)()
        bucket.buffer = [torch.empty_like(buffer) for buffer in full.buffer]
        bucket.index = full.index
        return bucket


def _background(optimizer):
    from .hierarchical import reducer_for
    reducer = reducer_for(getattr(optimizer, "dp_process_group", None))
    return getattr(reducer, "background", None) if reducer is not None else None


def bucket_full(optimizer, dtype):
    """Upstream's hook where a ZeRO-1/2 bucket is full: True when the bucket went to the background
    (``optimizer.ipg_buckets[dtype]`` is then a fresh one), False for upstream's synchronous
    reduction."""
    background = _background(optimizer)
    if background is None:
        return False
    background.bucket_full(optimizer, dtype)
    return True


def drain(optimizer):
    """Upstream's hook where the backward's gradients are all in (``independent_gradient_partition_
    epilogue``): finish every bucket still in the background, in order."""
    background = _background(optimizer)
    if background is not None:
        background.drain(optimizer)


def attach(reducer, setting, optimizer):
    """Give ``reducer`` a ``BackgroundReduction`` when ``overlap_decision`` says so (every rank
    alike), or none; a previous one's worker is stopped. Returns the note of why not, or None."""
    previous = getattr(reducer, "background", None) if reducer is not None else None
    if previous is not None:
        previous.close()
        reducer.background = None
    active, note = overlap_decision(setting, reducer, optimizer)
    if active:
        reducer.background = BackgroundReduction(reducer)
    return note