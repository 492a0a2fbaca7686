# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_config.communication.overlap``: ZeRO's hierarchical gradient reduction (ZeRO-1/2
buckets, ZeRO-3's reduce-scatter) runs in a background thread while the backward pass goes on
(docs/multihost.md, "Overlap with the backward").

On a GPU upstream overlaps a full bucket's reduction with the backward through a side stream; the
CPU accelerator has no streams, so with gloo every full bucket stops the backward until its
reduction (in-host reduce, the leaders' exchange, the hand-back) is done, and on a slow link
between hosts that is most of the step. Here a full bucket is reduced by one worker thread per
process while the main thread computes the next buckets' gradients; the step waits only for what
is still on the wire when the backward ends.

How, without touching upstream's bookkeeping (every step below is on the main thread except the
worker's collectives):

1. **Capture** (``bucket_full``, instead of upstream's reduction when a bucket is full): upstream's
   own code runs on copies of the bucket's gradients with the reducer in capture mode, so that each
   ``HierarchicalReducer.reduce(tensor, segments)`` it reaches is queued, not run: ZeRO-1/2's
   ``average_tensor`` on a copy of the bucket, ZeRO-3's ``__avg_scatter_grads`` with each
   parameter's gradient swapped for a copy (it may divide a lone gradient in place) and put back.
   The full bucket object is set aside, intact (its gradients are views of its buffer), and the
   optimizer gets a fresh bucket to fill.
2. **Background**: the worker runs the queued reductions strictly in order, each exactly as the
   synchronous path would (``HierarchicalReducer.reduce_to_owners``). Every rank's worker takes the
   buckets in the same order and only the worker uses the reducer's groups while buckets are
   pending, so each group sees the same sequence of collectives on every member.
3. **Replay** (at a later full bucket when ``DEPTH`` buckets are pending, and in ``drain`` at the
   backward's end, before upstream reduces the last, partial bucket): the set-aside bucket is put
   back and upstream's unchanged reduction (``reduce_ipg_grads``; ZeRO-3's
   ``__reduce_and_partition_ipg_grads``) runs with the reducer in replay mode. Each reduction it
   asks for is checked against the captured one (same size, same owners) and receives the
   worker's result; upstream's tail (each rank's slices into its gradient partition, the others
   cleared) runs as before, in the same order.

The replayed values are the bits the synchronous path computes from the same inputs (the same
division, flattening and reduction), so overlap on and off give bitwise-equal parameters
(tests/unit/heterogeneous/test_overlap.py). Time dilation (``emulation``) stretches the compute
before a bucket is handed to the worker, as a slower device would produce it later.

Where the capture could not be exact the reduction stays synchronous, decided once from the
optimizer and the same on every rank (``overlap_decision``): reduce_scatter false; for ZeRO-1/2 no
contiguous gradients, ZeRO-1 without ``overlap_comm`` (it reduces after the backward, with nothing
left to overlap), reduce-to-one-rank buckets (``use_multi_rank_bucket_allreduce`` false), MoE,
ZenFlow, Muon, CPU offload, fp32 accumulation of 16-bit gradients (the compact partition buffer) and
parameters larger than a bucket; for ZeRO-3 quantized gradients (qgZ), offload, ZenFlow and
parameters partitioned over a group the reducer does not serve; and everywhere an asynchronous
accelerator (upstream's ``overlap_comm`` streams overlap there), a backend other than gloo and
``comms_logger`` (its timers are shared between threads).

A backward that raises leaves its buckets pending, as upstream leaves its own bucket state: the
engine cannot go on training after it (a restart from a checkpoint can, ``elastic/``).
"""

import collections
import queue
import sys
import threading
import weakref

import torch

from ..measure import comm_clock
from .host_groups import settle

DEPTH = 3
"""Buckets reduced in the background at once: the most buckets set aside (each holds a bucket's
gradients in its own buffer, ``reduce_bucket_size`` elements), and how far the backward runs ahead
of the link before it waits for the oldest."""
CLOSE_TIMEOUT_S = 60.0
"""How long closing waits for the worker's collective to end before it says so and goes on."""


class OverlapError(RuntimeError):
    """The background reduction failed, or upstream's replay asked for another reduction than the
    one captured (a change in upstream's bucket slicing)."""


def overlap_decision(setting, reducer, optimizer, serves=None, offloaded_ranks=()):
    """Whether full ZeRO buckets are reduced in the background, and a note saying why not.

    Args:
        setting: ``communication.overlap`` (True, False or "auto").
        reducer: the ``HierarchicalReducer`` in force for the optimizer's group, or None.
        optimizer: the ZeRO-1/2 or ZeRO-3 optimizer, or anything else.
        serves: ``serves(group)``, whether ``reducer`` reduces ZeRO-3 gradients partitioned over
            ``group`` (``hierarchical.zero3_reducer(group) is reducer``); None: not checked.
        offloaded_ranks: the data-parallel ranks whose optimizer state is offloaded
            (``state.offloaded_ranks``, agreed at start-up): per-rank offload
            (``heterogeneous_offload``) sets this rank's optimizer flag on some ranks only, so the
            decision reads the agreed set, never the flag alone.

    Every input is the same on every rank (the agreed settings, the model, the config), so every
    rank decides alike. Raises ValueError naming the key when ``true`` cannot apply to the
    optimizer; without the hierarchical reduction (one host, as for ``hierarchical_reduction:
    true``) there is nothing to overlap and ``true`` is not an error."""
    if setting is False:
        return False, None
    return settle(setting, _why_not(reducer, optimizer, serves, tuple(offloaded_ranks)), "overlap",
                  "overlap where it applies", reducer is not None)


def expected(communication, zero, hosts):
    """Whether overlap may be in force for an engine under these settings, as the memory pool plans
    before the engine exists (its buckets are counted then; ``session.py`` drops them from the
    prediction once the engine decided against): ``communication`` (the fork's block), ``zero``
    (upstream's ``zero_optimization`` config), ``hosts`` (each data-parallel rank's, or None). An
    upper bound: the optimizer's own conditions (``_why_not``) are checked when it exists."""
    from .host_groups import group_layout
    if communication.overlap is False or communication.hierarchical_reduction is False:
        return False
    if not hosts or not group_layout(hosts).useful or int(zero.stage) < 1:
        return False
    offload = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    return not offload and bool(zero.reduce_scatter)


def _offload_reason(offloaded_ranks):
    return (f"data-parallel rank(s) {list(offloaded_ranks)} offload their optimizer state "
            "(zero_optimization.heterogeneous_offload), whose path copies its gradients out on its own")


def _why_not(reducer, optimizer, serves, offloaded_ranks=()):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm import comm as ds_comm
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    if reducer is None:
        return "the hierarchical reduction is not in force (one host, or hierarchical_reduction false)"
    if not isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        return ("it overlaps ZeRO-1/2/3's gradient buckets, and this run uses another optimizer (ZeRO-0, "
                "BF16_Optimizer)")
    if not get_accelerator().is_synchronized_device():
        # There upstream's overlap_comm reduces on its own stream; a second thread issuing collectives
        # on the same device would need stream ordering this module does not do.
        return "the accelerator is asynchronous (use upstream's zero_optimization.overlap_comm there)"
    if torch.distributed.get_backend() != "gloo":
        return f"the communication backend is {torch.distributed.get_backend()}, not gloo"
    if ds_comm.comms_logger.enabled:
        return "comms_logger is on (its per-operation timers are not thread-safe)"
    if type(optimizer) not in (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        return f"the optimizer is {type(optimizer).__name__}, a variant of ZeRO's (MiCS, SuperOffload, ZenFlow)"
    if getattr(sys.modules[type(optimizer).__module__], "overlap", None) is not sys.modules[__name__]:
        return "this DeepSpeed build lacks its hooks (patches/comm-overlapped-reduction.patch)"
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        checks = [
            (not optimizer.reduce_scatter, "zero_optimization.reduce_scatter is false"),
            (optimizer.all2all_process_group is not None, "ZeRO++'s quantized gradients (zero_quantized_gradients) "
             "are on"),
            (bool(offloaded_ranks), _offload_reason(offloaded_ranks)),
            (optimizer.offload_optimizer or getattr(optimizer, "offload_param", False),
             "ZeRO-3 offloads the optimizer state or the parameters"),
            (getattr(optimizer, "zenflow", False), "ZenFlow is on"),
            (serves is not None and not _zero3_groups_served(serves, optimizer), "some parameters are partitioned over a group the "
             "hierarchical reduction does not serve (MoE experts, AutoEP)"),
        ]
        return next((why for failed, why in checks if failed), None)
    checks = [
        (not optimizer.reduce_scatter, "zero_optimization.reduce_scatter is false"),
        (not optimizer.partition_gradients and not optimizer.overlap_comm,
         "ZeRO-1 reduces its buckets after the backward unless zero_optimization.overlap_comm is true"),
        (not optimizer.contiguous_gradients, "zero_optimization.contiguous_gradients is false"),
        (not optimizer.use_multi_rank_bucket_allreduce, "use_multi_rank_bucket_allreduce is false"),
        (bool(offloaded_ranks), _offload_reason(offloaded_ranks)),
        (optimizer.cpu_offload, "the optimizer state is offloaded to the CPU"),
        (getattr(optimizer, "zenflow", False), "ZenFlow is on"),
        (getattr(optimizer, "has_moe_layers", False), "the model has MoE layers"),
        (_uses_muon(optimizer), "the optimizer is Muon"),
        # Decided from the dtypes alone, the same on every rank (upstream's own test also reads this
        # rank's partition).
        (getattr(optimizer, "gradient_accumulation_dtype", None) == torch.float32
         and optimizer.dtype != torch.float32, "gradients of 16-bit parameters accumulate in fp32"),
        (any(p.numel() > optimizer.reduce_bucket_size for group in optimizer.bit16_groups for p in group),
         "a parameter is larger than reduce_bucket_size"),
    ]
    return next((why for failed, why in checks if failed), None)


def _zero3_groups_served(serves, optimizer):
    groups = {id(optimizer._get_param_partition_group(p)): optimizer._get_param_partition_group(p)
              for group in optimizer.fp16_groups for p in group}
    return all(serves(group) for group in groups.values())


def _uses_muon(optimizer):
    inner = getattr(optimizer, "optimizer", None)
    return type(inner).__name__ == "MuonWithAuxAdam"


class _Job:
    __slots__ = ("tensor", "segments", "run", "done", "error")

    def __init__(self, tensor, segments, run=None):
        self.tensor, self.segments = tensor, segments
        self.run = run  # another job for the worker (parameter_gather.py), else reduce tensor to its owners
        self.done = threading.Event()
        self.error = None


def wait_for_job(job, what):
    """The main thread waits for the worker's ``job`` (exposed communication on the comm clock) and
    raises its failure as an ``OverlapError`` naming ``what`` the job was."""
    if comm_clock.enabled and comm_clock.before_collective is not None and not job.done.is_set():
        comm_clock.before_collective()  # time dilation: a slower device reaches the wait later
    if not job.done.is_set():
        comm_clock.enter()  # the step or the forward waits for the link: exposed communication
        try:
            job.done.wait()
        finally:
            comm_clock.leave()
    if job.error is not None:
        raise OverlapError(f"deepspeed-hetero: the background {what} failed: {job.error}") from job.error


class BackgroundReduction:
    """One optimizer's buckets reduced by one worker thread through ``reducer`` (see the module)."""

    def __init__(self, reducer, stage, optimizer, depth=DEPTH):
        self.reducer = reducer
        self.optimizer = weakref.ref(optimizer)
        self.stage = stage  # 1 or 2 (DeepSpeedZeroOptimizer), 3 (DeepSpeedZeroOptimizer_Stage3)
        self.depth = depth
        self.mode = None  # "capture" | "replay" | None: what HierarchicalReducer.reduce does
        self.pending = collections.deque()  # (dtype, bucket, jobs), oldest first
        self._captured = None
        self._replaying = None
        self._spare = {}  # dtype -> buckets whose buffers may be filled again
        self._queue = queue.SimpleQueue()
        self._failure = None
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="deepspeed-hetero-overlap", daemon=True)
        self._thread.start()

    # -- the worker ---------------------------------------------------------------------------

    def _work(self):
        comm_clock.mark_background_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._failure is None and self._closed:
                # An engine built anew while buckets were pending (its backward raised): the new
                # engine's worker owns the groups now, so these are never run.
                self._failure = OverlapError("deepspeed-hetero: the background reduction was closed")
            if self._failure is None:
                try:
                    if job.run is not None:
                        job.run()
                    else:
                        self.reducer.reduce_to_owners(job.tensor, job.segments)
                except BaseException as exc:  # noqa: BLE001 -- surfaced on the main thread at replay
                    self._failure = exc
            job.error = self._failure
            job.done.set()

    def submit(self, jobs):
        """Queue other jobs (``_Job`` with ``run``) behind what is queued: every rank must submit
        the same jobs at the same point of its sequence."""
        for job in jobs:
            self._queue.put(job)

    def close(self, timeout=CLOSE_TIMEOUT_S):
        """Stop the worker (the reducer is replaced or dropped) and wait for it: what is still queued
        is not run, but a collective it is inside must end first, or a new worker would use the same
        groups beside it. Returns whether it ended within ``timeout`` seconds; if not, says so (its
        collective ends with the process group's timeout, or when its peers join it)."""
        self._closed = True
        self._queue.put(None)
        if self._thread is threading.current_thread():
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            from deepspeed.utils import logger
            logger.warning(f"deepspeed-hetero: the overlap worker is still inside a collective {timeout:g} s after it "
                           "was closed; the next reduction waits for it (a peer rank that did not reach the same "
                           "collective ends it at the process group's timeout)")
            return False
        return True

    @property
    def alive(self):
        return self._thread.is_alive()

    # -- the main thread ----------------------------------------------------------------------

    def bucket_full(self, optimizer, dtype):
        """Set the full bucket of ``dtype`` aside and have its reduction run in the background;
        ``optimizer.ipg_buckets[dtype]`` is then a fresh bucket."""
        if len(self.pending) >= self.depth:
            self._replay_oldest(optimizer)
        bucket = optimizer.ipg_buckets[dtype]  # never empty: upstream calls only when it holds elements
        self._captured, self.mode = [], "capture"
        try:
            self._capture(optimizer, bucket, dtype)
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
        """``HierarchicalReducer.reduce(tensor, segments)`` while capturing or replaying."""
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
        wait_for_job(job, "gradient reduction")

    def _capture(self, optimizer, bucket, dtype):
        """Run upstream's reduction of ``bucket`` on copies of its gradients, the reducer capturing."""
        if self.stage != 3:
            optimizer.average_tensor(bucket.buffer[bucket.index].narrow(0, 0, bucket.elements).clone(), dtype)
            return
        # ZeRO-3 reads each parameter's .grad (a view of the bucket's buffer) and may divide it in
        # place: the capture works on copies, and the gradients are put back untouched.
        params = sorted(bucket.params, key=lambda p: p.ds_id)
        saved = [p.grad.data for p in params]
        try:
            for param, grad in zip(params, saved):
                param.grad.data = grad.clone()
            optimizer._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(params, dtype)
        finally:
            for param, grad in zip(params, saved):
                param.grad.data = grad

    def _replay_oldest(self, optimizer):
        dtype, bucket, jobs = self.pending.popleft()
        current = optimizer.ipg_buckets[dtype]
        optimizer.ipg_buckets[dtype] = bucket
        self._replaying, self.mode = collections.deque(jobs), "replay"
        try:
            if self.stage == 3:
                optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads(dtype)
            else:
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
        if self.stage == 3:
            bucket.buffer = None if full.buffer is None else torch.empty_like(full.buffer)
            bucket.buffer_meta = full.buffer_meta
            return bucket
        bucket.buffer = [torch.empty_like(buffer) for buffer in full.buffer]
        bucket.index = full.index
        return bucket


ATTRIBUTE = "_heterogeneous_background_reduction"
"""The optimizer's ``BackgroundReduction``, set by ``attach`` (absent: upstream's synchronous path)."""


def bucket_full(optimizer, dtype):
    """Upstream's hook where a ZeRO bucket is full: True when the bucket went to the background
    (``optimizer.ipg_buckets[dtype]`` is then a fresh one), False for upstream's synchronous
    reduction."""
    background = getattr(optimizer, ATTRIBUTE, None)
    if background is None:
        return False
    background.bucket_full(optimizer, dtype)
    return True


def drain(optimizer):
    """Upstream's hook where the backward's gradients are all in (``independent_gradient_partition_
    epilogue``), or before a bucket is reduced synchronously: finish every bucket still in the
    background, in order."""
    background = getattr(optimizer, ATTRIBUTE, None)
    if background is not None:
        background.drain(optimizer)


def attach(reducer, setting, optimizer, serves=None, offloaded_ranks=()):
    """Give ``reducer`` and ``optimizer`` a ``BackgroundReduction`` when ``overlap_decision`` says so
    (every rank alike), or none; a previous one's worker is stopped. Returns the note of why not,
    or None."""
    previous = getattr(reducer, "background", None) if reducer is not None else None
    if previous is not None:
        previous.close()
        reducer.background = None
        owner = previous.optimizer()
        if owner is not None and getattr(owner, ATTRIBUTE, None) is previous:
            delattr(owner, ATTRIBUTE)  # an earlier engine's optimizer reduces synchronously again
    active, note = overlap_decision(setting, reducer, optimizer, serves, offloaded_ranks)
    if active:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        stage = 3 if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3) else 2
        reducer.background = BackgroundReduction(reducer, stage, optimizer)
        setattr(optimizer, ATTRIBUTE, reducer.background)
    return note