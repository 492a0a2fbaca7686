# SPDX-License-Identifier: Apache-2.0
"""The fork's collectives, at the edge: pool the ranks' measurements, send rank 0's decision.

Every decision of the fork (the plan after a profiling step, a rebalance, a switch judged) is
taken on data-parallel rank 0 and broadcast, so all ranks switch at the same step boundary with
the same plan. Every collective the fork issues outside the gradient path goes through
``Agreement``: ``gather_to_rank0`` (what only rank 0 decides with), ``gather_from_every_rank``
(what every rank keeps: the devices at start-up, the profiling steps' measurements, the
profiler's records), ``broadcast_from`` and ``barrier``.

When a peer dies or hangs, the collective fails on the survivors. To name the rank that failed
rather than only the rank that reports it, every process checks in at the rendezvous store
before each agreement (one small store write, only at agreement steps); a failed collective
then reads which processes never arrived. The store lives on global rank 0: when rank 0 is the
one that died the store is unreachable, and the message says so.

``merge_replicas`` (pure) folds the contributions of model-parallel peers into one entry per
data-parallel rank; the heterogeneous profiler merges its records with it too.

``check_settings_agree`` runs once per process and setting before any collective of the fork:
every rank must run the same blocks and environment switches, and a rank that has the fork off
(an environment variable set on one node only) never joins a collective of the fork. So the
settings go through the rendezvous store, where a missing rank ends in an error naming it
instead of a hang, and a mismatch in an error naming the setting.
"""

import json
import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from deepspeed import comm as dist
from deepspeed.utils import logger

_CHECK_IN_KEY = "deepspeed-hetero/agreement/{rank}"


class PlanAgreementError(RuntimeError):
    """A peer failed while the ranks were agreeing on a plan; the message names it when it can."""

    deepspeed_hetero_consequence = True  # the exception hook points to the peer's own error (config/errors.py)


_entered = 0
"""Agreements this process has entered, through any ``Agreement``: the same count on every live
process, since every agreement is a collective of all of them. One count per process, not per
instance: the check-in key is one per rank, and the start-up code makes a new instance for each of
its agreements, so counts per instance would compare one instance's progress with another's."""


class Agreement:
    """This process's side of the agreements; ``rank_label`` names it in messages."""

    def __init__(self, rank_label):
        self.rank_label = rank_label
        self.sequence = 0  # the process's count (``_entered``) at this instance's latest agreement

    def gather_from_every_rank(self, entry, what):
        """Every process's ``entry``, in global rank order. ``what`` completes "could not gather ..."."""
        gathered = [None] * dist.get_world_size()
        self._check_in()
        try:
            dist.all_gather_object(gathered, entry)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: {self.rank_label} could not gather {what}; "
                                     f"{self._who_failed(source=None)} ({exc})") from exc
        return gathered

    def gather_to_rank0(self, entry, what):
        """Every process's ``entry`` on global rank 0, in global rank order; None on the others.
        Two collectives (the sizes, then the pickled entries padded to the longest), so that only
        rank 0 receives the payload."""
        import torch
        world, rank = dist.get_world_size(), dist.get_rank()
        self._check_in()
        try:
            device = _collective_device()
            data = torch.frombuffer(bytearray(pickle.dumps(entry)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.long, device=device)
            sizes = [torch.zeros_like(size) for _ in range(world)]
            dist.all_gather(sizes, size)
            lengths = [int(s.item()) for s in sizes]
            padded = torch.zeros(max(lengths), dtype=torch.uint8)
            padded[:data.numel()] = data
            padded = padded.to(device)
            buffers = [torch.zeros_like(padded) for _ in range(world)] if rank == 0 else None
            dist.gather(padded, gather_list=buffers, dst=0)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: {self.rank_label} could not gather {what}; "
                                     f"{self._who_failed(source=None)} ({exc})") from exc
        if rank != 0:
            return None
        return [pickle.loads(buffer[:length].cpu().numpy().tobytes()) for buffer, length in zip(buffers, lengths)]

    def broadcast_from_rank0(self, decision, what):
        """Rank 0's ``decision`` (a picklable object) on every process; others pass None."""
        return self.broadcast_from(0, decision, what)

    def broadcast_from(self, source, value, what):
        """Global rank ``source``'s ``value`` (picklable) on every process; others pass None."""
        box = [value]
        self._check_in()
        try:
            dist.broadcast_object_list(box, src=source)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: {self.rank_label} did not receive {what} from global "
                                     f"rank {source}; {self._who_failed(source=source)} ({exc})") from exc
        return box[0]

    def barrier(self, what):
        """Wait until every process reaches this point; ``what`` completes "waiting for ..."."""
        self._check_in()
        try:
            dist.barrier()
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: {self.rank_label} stopped waiting for {what}; "
                                     f"{self._who_failed(source=None)} ({exc})") from exc

    def _check_in(self):
        global _entered
        _entered += 1
        self.sequence = _entered
        store = _store()
        if store is None:
            return
        try:
            store.set(_CHECK_IN_KEY.format(rank=dist.get_rank()), str(self.sequence))
        except Exception:  # the collective that follows reports the failure
            pass

    def _who_failed(self, source):
        missing = missing_ranks(_store(), dist.get_world_size(), self.sequence)
        if missing is None:
            if source == 0:
                return ("global rank 0, the broadcast's source, failed or exited: the rendezvous store it hosts "
                        "cannot be read either")
            return ("a peer rank failed or timed out; which one is unknown: the rendezvous store, hosted by "
                    "global rank 0, cannot be read, as when rank 0 itself has exited")
        if missing:
            return f"a peer rank failed or timed out: global rank(s) {missing} never reached this agreement"
        return "a peer rank failed or timed out inside this agreement (every rank reached it)"


def missing_ranks(store, world_size, sequence):
    """Global ranks whose last check-in is older than ``sequence``; None if the store cannot be read."""
    if store is None:
        return None
    try:
        missing = []
        for rank in range(world_size):
            key = _CHECK_IN_KEY.format(rank=rank)
            # check() does not wait, unlike get() on a missing key.
            if not store.check([key]) or int(store.get(key)) < sequence:
                missing.append(rank)
        return missing
    except Exception:
        return None


def _collective_device():
    """Where tensors of a collective must live: the host for gloo, the device otherwise (NCCL)."""
    import torch.distributed
    if not torch.distributed.is_initialized() or torch.distributed.get_backend() == "gloo":
        return "cpu"
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().current_device_name()


def _store():
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # no torch.distributed group (another comm backend): messages stay general
        return None


def by_replica(pairs):
    """``{dp_rank: [value, ...]}`` from ``(dp_rank, value)`` pairs, in one pass (gathered entries are
    grouped once, not searched once per rank: O(N), not O(N^2), for N ranks)."""
    groups = {}
    for rank, value in pairs:
        groups.setdefault(rank, []).append(value)
    return groups


def largest_per_replica(pairs, data_parallel_size, default=None, error=ValueError):
    """Per data-parallel rank 0..size-1, the largest value its processes reported (``pairs``:
    ``(dp_rank, value)``; a replica counts its fullest member); ``default`` where none did, or
    ``error`` when ``default`` is None."""
    groups = by_replica(pairs)
    values = []
    for rank in range(data_parallel_size):
        if rank in groups:
            values.append(max(groups[rank]))
        elif default is not None:
            values.append(default)
        else:
            raise error(f"deepspeed-hetero: no process reported data-parallel rank {rank}")
    return values


def merge_replicas(contributions, data_parallel_size, sequences, error=ValueError):
    """One entry per data-parallel rank from every process's contribution.

    Args:
        contributions: dicts with ``dp_rank``, per-step lists under the keys of ``sequences``
            and numeric fields; model-parallel members of one replica ran the same steps, so
            their lists have the same length.
        sequences: ``{key: merge_items}``; ``merge_items(items, dp_rank)`` makes one item from
            the members' items at one index (a step counts at its slowest member: the replica
            waits for it).
        error: the exception type raised when a rank is missing or its members disagree.

    Numeric fields are the largest value any member reported (None when none did).
    """
    merged, groups = [], by_replica((c["dp_rank"], c) for c in contributions)
    for rank in range(data_parallel_size):
        members = groups.get(rank, [])
        if not members:
            raise error(f"deepspeed-hetero: no process reported data-parallel rank {rank}")
        entry = {}
        for key in members[0]:
            if key == "dp_rank":
                continue
            if key in sequences:
                lengths = [len(m[key]) for m in members]
                if len(set(lengths)) != 1:
                    raise error(f"deepspeed-hetero: the model-parallel members of data-parallel rank {rank} "
                                f"reported different numbers of {key} ({lengths}); they must run the same plan")
                entry[key] = [sequences[key](items, rank) for items in zip(*(m[key] for m in members))]
            else:
                known = [m[key] for m in members if m.get(key) is not None]
                entry[key] = max(known) if known else None
        merged.append(entry)
    return merged


# -- the ranks' settings agree (as a config is coordinated) ----------------------------------------

_SETTINGS_KEY = "deepspeed-hetero/settings/{round}/{rank}"
_VERDICT_KEY = "deepspeed-hetero/settings/{round}/verdict"
SETTINGS_TIMEOUT_S = None
"""How long rank 0 waits for every rank's settings; None: the process group's timeout (the
store's), as long as upstream's first collective would wait for a late rank."""
WAIT_NOTICE_S = 60.0
"""After this long, say which ranks are awaited (the wait itself goes on)."""
_FIX = ("every rank must run the same heterogeneous settings: set the environment variables on every node "
        "(srun and torchrun do not forward them; the deepspeed launcher does) and give every rank the same "
        "ds_config")
_rounds = 0  # configs with the fork enabled built by this process: the same count on every rank


class SettingsMismatchError(ValueError):
    """The ranks run different heterogeneous settings, or some run without the fork."""


def check_settings_agree(summary):
    """Raise ``SettingsMismatchError`` on every rank unless every rank's ``summary``
    (``config.settings_summary``) is the same; called by each rank with the fork enabled.

    Each rank puts its summary in the store; rank 0 waits for all of them (a rank without the fork
    never writes one: the wait ends after ``SETTINGS_TIMEOUT_S`` with an error naming it), reads them
    in one round trip, compares and publishes the verdict, which every rank raises alike: four store
    calls on rank 0 and three on the others, whatever the world (the store serves 3N + 1). Nothing
    when the world is one process or there is no store (another comm backend).
    """
    global _rounds
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = _store()
    if store is None:
        return
    _rounds += 1
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = [_SETTINGS_KEY.format(round=_rounds, rank=r) for r in range(world)]
    verdict_key = _VERDICT_KEY.format(round=_rounds)
    store.set(keys[rank], json.dumps(summary))
    timeout = _settings_timeout(store)
    if rank == 0:
        missing = _wait_for(store, keys, timeout, "every rank's heterogeneous settings")
        if missing:
            verdict = missing_ranks_message(missing, world, summary, timeout)
        else:
            verdict = settings_mismatch([json.loads(value) for value in _get_all(store, keys)]) or ""
        store.set(verdict_key, verdict)
    else:
        # Rank 0 publishes a verdict, possibly after waiting out its own timeout for a late rank.
        if _wait_for(store, [verdict_key], timeout + max(30.0, 0.1 * timeout), "rank 0's verdict on the settings"):
            verdict = (f"deepspeed-hetero: global rank 0 did not check the ranks' heterogeneous settings within "
                       f"{timeout:.0f} s: it runs without the fork (no heterogeneous_config block and "
                       f"DS_HETEROGENEOUS_ENV unset there?) or is stuck; here {_env_text(summary)}; {_FIX}")
        else:
            verdict = store.get(verdict_key).decode()
    if verdict:
        raise SettingsMismatchError(verdict)


def _get_all(store, keys):
    """Every key's value, in one round trip to the store where it can (``multi_get``): rank 0 reads
    N summaries, and N round trips would grow with the world; else one by one."""
    try:
        return store.multi_get(keys)
    except (AttributeError, NotImplementedError, RuntimeError):
        return [store.get(key) for key in keys]


def _settings_timeout(store):
    if SETTINGS_TIMEOUT_S is not None:
        return float(SETTINGS_TIMEOUT_S)
    try:
        return store.timeout.total_seconds()
    except Exception:
        return 1800.0  # torch's default process-group timeout


def _wait_for(store, keys, timeout, what):
    """Wait until every key is set; returns the keys still missing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    noticed = False
    while True:
        remaining = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(0.001, min(remaining, WAIT_NOTICE_S))))
            return []
        except Exception:  # a timeout (DistStoreError); which keys are missing is read below
            missing = [key for key in keys if not store.check([key])]
            if not missing:
                return []
            if time.monotonic() >= deadline:
                return missing
            if not noticed:
                noticed = True
                ranks = [key.rsplit("/", 1)[1] for key in missing]
                logger.warning(f"deepspeed-hetero: still waiting for {what} ({', '.join(ranks)}) after "
                               f"{WAIT_NOTICE_S:.0f} s; a rank that runs without the fork never reports, and the "
                               f"wait ends with an error after {timeout:.0f} s")


def _rank_list(ranks):
    ranks = sorted(ranks)
    shown = ranks if len(ranks) <= 8 else ranks[:6] + ["..."] + ranks[-1:]
    return "[" + ", ".join(str(r) for r in shown) + "]" + (f" ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _env_text(summary):
    return ", ".join(f"{name} is {_env_value(value)}" for name, value in summary["env"].items())


def _env_value(value):
    return "unset" if value is None else repr(value)


def missing_ranks_message(missing_keys, world_size, summary, timeout):
    """The error when ranks never reported their settings (they run without the fork)."""
    missing = [int(key.rsplit("/", 1)[1]) for key in missing_keys]
    present = [rank for rank in range(world_size) if rank not in missing]
    return (f"deepspeed-hetero: global ranks {_rank_list(missing)} did not report their heterogeneous settings "
            f"within {timeout:.0f} s while ranks {_rank_list(present)} run with heterogeneous_config enabled "
            f"(on rank 0 {_env_text(summary)}): the missing ranks run without the fork (no heterogeneous_config "
            f"block, DS_HETEROGENEOUS_ENV unset there) or are stuck; {_FIX}")


def settings_mismatch(summaries):
    """The message naming every environment switch and setting that differs between ranks
    (``summaries`` in global rank order), or None when all agree. Pure."""
    differences = []
    for part, show in (("env", _env_value), ("settings", lambda value: json.dumps(value))):
        names = list(dict.fromkeys(name for summary in summaries for name in summary[part]))
        for name in names:
            groups = {}
            for rank, summary in enumerate(summaries):
                groups.setdefault(show(summary[part].get(name)), []).append(rank)
            if len(groups) > 1:
                parts = [f"{value} on ranks {_rank_list(ranks)}" for value, ranks in groups.items()]
                differences.append(f"{name} is " + ", ".join(parts[:-1]) + f" and {parts[-1]}")
    if not differences:
        return None
    return "deepspeed-hetero: the ranks run different heterogeneous settings: " + "; ".join(differences) + f"; {_FIX}"


def decision_failure(exc):
    """Rank 0's failed decision as the box every rank receives: the exception's type and message."""
    return {"error": str(exc), "type": type(exc).__name__}


class PlanDecisionError(RuntimeError):
    """Rank 0 failed while deciding a plan; raised on every rank, with rank 0's exception."""


@dataclass
class PlanDecision:
    """What rank 0 decided at an agreement point (after a profiling step, at a check), broadcast
    so that every rank acts on it alike. Plain values only: the plan travels as its dict."""

    plan: Optional[dict] = None
    """The plan to run from the next step (``Plan.to_dict()``); None: the plan in force stays."""
    reason: str = ""
    """Why (a re-plan's or a revert's reason, or why the plan stays)."""
    revert: bool = False
    """The plan undoes the last switch, which made the step slower."""
    gain: float = 0.0
    """The predicted step-time gain of ``plan``."""
    wall: Optional[float] = None
    """The median step wall time (s) that led to a re-plan."""
    note: Optional[str] = None
    """A line for the log (what was judged, why a plan was kept)."""
    verify: bool = False
    """A switch awaits its check: the controller measures until it is judged."""
    peaks: Optional[list] = None
    """Per data-parallel rank, its measured peak bytes in the interval (checks only)."""
    activations: Optional[list] = None
    """Per data-parallel rank, its measured activation bytes per sample (checks only)."""
    failure: Optional[dict] = None
    """Rank 0's exception (``decision_failure``): every rank raises it."""

    @classmethod
    def failed(cls, exc):
        return cls(failure=decision_failure(exc))

    def raise_failure(self, what):
        """On every rank: raise rank 0's failure, if it failed (``raise_decision_failure``)."""
        if self.failure is not None:
            raise_decision_failure(self.failure, what)


def raise_decision_failure(box, what):
    """On every rank: raise rank 0's failure from ``decision_failure``. A ValueError (the planner's
    and the measurements' errors say what to change) stays a ValueError; anything else is a
    PlanDecisionError naming its type."""
    kind = box.get("type", "ValueError")
    if kind == "ValueError":
        raise ValueError(f"deepspeed-hetero: {what}: {box['error']}")
    raise PlanDecisionError(f"deepspeed-hetero: {what}: rank 0 raised {kind}: {box['error']}")


def slowest_micro_step(steps, rank):
    """One micro-step of a replica: its members ran the same size; it took the slowest one's time."""
    sizes = {size for size, _, _ in steps}
    if len(sizes) != 1:
        raise PlanAgreementError(f"deepspeed-hetero: the model-parallel members of data-parallel rank {rank} "
                                 f"ran different micro-batch sizes {sorted(sizes)}")
    activations = [b for _, _, b in steps if b is not None]
    return sizes.pop(), max(t for _, t, _ in steps), max(activations) if activations else None


def slowest(values, rank):
    return max(values)
