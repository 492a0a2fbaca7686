# SPDX-License-Identifier: Apache-2.0
"""This process's sequence of collectives, recorded so that the ranks' sequences can be compared.

Every rank must issue the same collectives in the same order with the same shapes
(docs/architecture.md, "Invariants"): a rank that runs one more micro-step's reduction, another bucket size
or a scaler that reduces one more value pairs its collectives with the wrong ones of its peers,
which ends in a hang or, worse, in silently wrong sums. Nothing at run time sees that, so the
tests record each rank's sequence while it trains and compare them op by op.

The recorder listens where the comm clock already sits: ``deepspeed.comm.timed_op`` hands every
collective to ``comm_clock.timed_call``, which passes the undecorated function and its arguments
to the listener set here. The fork's own agreements (``all_gather_object``,
``broadcast_object_list``) go through ``deepspeed.comm`` like upstream's, so they are in the
sequence too. Not seen: deepspeed.comm functions without ``timed_op`` (``all_gather_coalesced``)
and direct torch.distributed calls; the fork makes neither. With the recorder off nothing is
recorded and timed_op's cost is unchanged.

An entry keeps what must agree across ranks: the op, the group's global ranks, each tensor's
shape and dtype, the reduce op, root and tag, and whether the op is asynchronous. It leaves out
what legitimately differs: the pickled payload of object collectives (only the length of the
object list is kept), the root-only lists of ``gather``/``scatter``, ``all_to_all``'s split sizes,
and upstream's logging arguments. Point-to-point ops are recorded too; a send pairs with a
receive, so sequences with them are compared by the caller's own rule, not for equality.
"""

import inspect
import threading
from contextlib import contextmanager
from typing import NamedTuple, Tuple

import torch

from . import comm_clock

# Arguments that do not shape the collective, or that legitimately differ across ranks.
_IGNORED = frozenset({"prof", "log_name", "debug", "obj", "gather_list", "scatter_list", "output_split_sizes",
                      "input_split_sizes"})


class Collective(NamedTuple):
    """One collective as this rank issued it; equal entries on every rank pair up correctly."""

    op: str
    group: Tuple[int, ...]  # global ranks of the group
    tensors: Tuple[Tuple[str, Tuple], ...]  # (argument, (shape, dtype) or a tuple of them)
    details: Tuple[Tuple[str, object], ...]  # reduce op, root, tag, object-list length ...
    async_op: bool

    def __str__(self):
        parts = [f"group={list(self.group)}"]
        parts += [f"{name}={_format_tensors(value)}" for name, value in self.tensors]
        parts += [f"{name}={value}" for name, value in self.details]
        return f"{self.op}({', '.join(parts)}){' async' if self.async_op else ''}"


def _format_tensors(value):
    if len(value) == 2 and isinstance(value[1], str):  # one tensor: (shape, dtype)
        return f"{value[1]}{list(value[0])}"
    return "[" + ", ".join(_format_tensors(item) for item in value) + "]"


def _tensor(value):
    return tuple(value.shape), str(value.dtype).replace("torch.", "")


def _plain(value):
    """A value that compares equal across ranks and pickles: enums by name, the rest as they are
    when they are plain, else their type's name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = getattr(value, "name", None)
    if isinstance(name, str):
        return name  # ReduceOp members of deepspeed.comm and of torch.distributed alike
    return type(value).__name__


def describe(op, arguments, group_ranks):
    """The entry for collective ``op`` called with ``arguments`` (parameter name -> value, defaults
    included) on the group whose global ranks are ``group_ranks``. Pure."""
    tensors, details, async_op = [], [], False
    for name, value in arguments.items():
        if name in _IGNORED or name == "group":
            continue
        if name == "async_op":
            async_op = bool(value)
        elif name == "object_list":
            details.append(("objects", len(value)))
        elif isinstance(value, torch.Tensor):
            tensors.append((name, _tensor(value)))
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            tensors.append((name, tuple(_tensor(v) for v in value)))
        elif isinstance(value, (list, tuple)):
            details.append((name, tuple(_plain(v) for v in value)))
        else:
            details.append((name, _plain(value)))
    return Collective(op, tuple(group_ranks), tuple(tensors), tuple(details), async_op)


def first_mismatch(sequences):
    """The first index at which the ranks' sequences differ, or None when they are identical.
    A sequence that ended early counts as differing at its end."""
    length = max(len(s) for s in sequences)
    for index in range(length):
        entries = [s[index] if index < len(s) else None for s in sequences]
        if any(entry != entries[0] for entry in entries[1:]):
            return index
    return None


def mismatch_report(sequences, context=2):
    """A readable account of where the ranks' sequences part, or '' when they are identical: the
    index, each rank's entry there and a few entries before it, and each rank's count."""
    index = first_mismatch(sequences)
    if index is None:
        return ""
    lines = [f"collective sequences differ at index {index} "
             f"(lengths: {', '.join(f'rank {r}: {len(s)}' for r, s in enumerate(sequences))})"]
    for position in range(max(0, index - context), index):
        lines.append(f"  [{position}] all ranks: {sequences[0][position]}")
    for rank, sequence in enumerate(sequences):
        entry = sequence[index] if index < len(sequence) else "<no more collectives>"
        lines.append(f"  [{index}] rank {rank}: {entry}")
    return "\n".join(lines)


def assert_same_collectives(sequences, what="training"):
    """Raise AssertionError with ``mismatch_report`` unless every rank's sequence is the same."""
    report = mismatch_report(sequences)
    if report:
        raise AssertionError(f"{what}: {report}")


# -- recording ------------------------------------------------------------------------------------

_signatures = {}
_lock = threading.Lock()


def _group_ranks(group):
    from deepspeed import comm as dist
    if group is None:
        return range(dist.get_world_size())
    try:
        return torch.distributed.get_process_group_ranks(group)
    except Exception:  # a group of another comm backend
        return dist.get_all_ranks_from_group(group)


class Entries(list):
    """The main thread's collectives; ``background``: the background worker's, in its order."""

    def __init__(self):
        super().__init__()
        self.background = []


class Recorder:
    """Appends every collective this process issues to ``entries`` while it is the listener; those
    of a background worker (``comm/overlap.py``) to ``entries.background``: each thread's sequence is
    the same on every rank, their interleaving is not."""

    def __init__(self):
        self.entries = Entries()

    def __call__(self, func, args, kwargs):
        try:
            signature = _signatures.get(func)
            if signature is None:
                signature = _signatures[func] = inspect.signature(func)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            entry = describe(func.__name__, arguments, _group_ranks(arguments.get("group")))
        except Exception as exc:  # the collective must still run: a rank that skipped it would hang its peers
            entry = Collective(func.__name__, (), (), (("unrecorded", f"{type(exc).__name__}: {exc}"), ), False)
        with _lock:
            (self.entries.background if comm_clock.in_background_thread() else self.entries).append(entry)


@contextmanager
def recording():
    """Record this process's collectives inside the block; yields the list being filled.

    One recording at a time: nesting would hide which block issued what."""
    if comm_clock.listener is not None:
        raise RuntimeError("deepspeed-hetero: a collective recording is already running in this process")
    recorder = Recorder()
    comm_clock.set_listener(recorder)
    try:
        yield recorder.entries
    finally:
        comm_clock.set_listener(None)
