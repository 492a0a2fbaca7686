# SPDX-License-Identifier: Apache-2.0
"""The runtime's collectives, at the edge: pool every rank's measurements, send rank 0's decision.

Every decision of the fork (the plan after a profiling step, a rebalance) is taken on rank 0
from every rank's measurements and broadcast, so all ranks switch at the same step boundary
with the same plan. Two collectives do that, and they are the only ones the runtime issues:
``gather_from_every_rank`` and ``broadcast_from_rank0``.

When a peer dies or hangs, the collective fails on the survivors. To name the rank that failed
rather than only the rank that reports it, every process checks in at the rendezvous store
before each agreement (one small store write, only at agreement steps); a failed collective
then reads which processes never arrived. The store lives on global rank 0: when rank 0 is the
one that died the store is unreachable, and the message says so.

``merge_replicas`` (pure) folds the contributions of model-parallel peers into one entry per
data-parallel rank; the heterogeneous profiler merges its records with it too.
"""

from deepspeed import comm as dist

_CHECK_IN_KEY = "deepspeed-hetero/agreement/{rank}"


class PlanAgreementError(RuntimeError):
    """A peer failed while the ranks were agreeing on a plan; the message names it when it can."""


class Agreement:
    """This process's side of the agreements; ``rank_label`` names it in messages."""

    def __init__(self, rank_label):
        self.rank_label = rank_label
        self.sequence = 0  # agreements entered so far: the same count on every live process

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

    def broadcast_from_rank0(self, decision, what):
        """Rank 0's ``decision`` (a picklable object) on every process; others pass None."""
        box = [decision]
        self._check_in()
        try:
            dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            raise PlanAgreementError(f"deepspeed-hetero: {self.rank_label} did not receive {what} from global "
                                     f"rank 0; {self._who_failed(source=0)} ({exc})") from exc
        return box[0]

    def _check_in(self):
        self.sequence += 1
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


def _store():
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # no torch.distributed group (another comm backend): messages stay general
        return None


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
    merged = []
    for rank in range(data_parallel_size):
        members = [c for c in contributions if c["dp_rank"] == rank]
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
