# SPDX-License-Identifier: Apache-2.0
"""How a failed job says why: every error seen once, from the rank that raised it.

An uncaught exception ends a rank. Left to Python, each rank prints its own traceback: an error
every rank raises (a config mistake, a placement that does not fit) is printed N times, and an
error one rank raises is followed by N-1 tracebacks of peers whose collective broke ("Connection
closed by peer") that do not say why. The fork's exception hook (``one_line_config_errors``)
instead:

1. posts the error to the process group's rendezvous store (``deepspeed-hetero/failure/<rank>``:
   its kind, its message, whether it is a consequence of a peer's failure);
2. waits ``GRACE_S`` for the peers that fail with it to post theirs, reads every rank's post;
3. prints what ``report_line`` decides: an error every rank raised alike, once, from the lowest
   rank (one line for the fork's errors, the traceback once for others); an error some ranks
   raised, once, from the lowest of them, named by its rank; a rank that stopped because of a peer
   (a broken collective), one line pointing to the rank that failed first;
4. a rank that prints nothing, or only points to a peer, stays ``GRACE_S`` more, so that the rank
   that prints the error does so before a launcher ends the job at the first exit; global rank 0,
   which hosts the store under the ``deepspeed`` launcher, stays ``GRACE_S`` more so that the others
   can read it.

Without a store (no process group yet), the rank prints its own report, the fork's errors on one
line, from global rank 0 alone where every rank raises them (a config parsed before the group).

A ds_config file that does not parse raises a ``HeterogeneousConfigError`` (``config_file_errors``),
naming the file, the line and the column.
"""

import contextlib
import json
import os
import sys
import time
import traceback as traceback_module

from .settings import HeterogeneousConfigError

FAILURE_KEY = "deepspeed-hetero/failure/{rank}"
GRACE_S = 1.0
"""Seconds a failing rank waits for its peers' posts before it decides what to print."""


def one_line_config_errors():
    """Install the fork's exception hook, once per process (every later call is a no-op): every
    error seen once (the module docstring). The fork installs it as a config is parsed with the fork
    on, and wherever it raises an error every rank raises together."""
    if getattr(sys.excepthook, "deepspeed_hetero", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):  # the person at the terminal knows why
            return previous(kind, value, tb)
        try:
            _report(kind, value, tb, previous)
        except Exception:  # noqa: BLE001 -- reporting must never hide the error itself
            previous(kind, value, tb)

    hook.deepspeed_hetero = True
    sys.excepthook = hook


def is_fork_error(value):
    """The fork's own errors (and those marked as raised by every rank together) end on one line."""
    return isinstance(value, HeterogeneousConfigError) or getattr(value, "deepspeed_hetero_every_rank", False) or \
        type(value).__module__.startswith("deepspeed.runtime.heterogeneous")


def is_consequence(value):
    """An error a rank raises because a peer failed: a broken or timed-out collective."""
    if getattr(value, "deepspeed_hetero_consequence", False):  # cluster/agreement.PlanAgreementError
        return True
    text = str(value)
    return any(marker in text for marker in ("Connection closed by peer", "Connection reset by peer",
                                              "Broken pipe", "timed out", "Timed out"))


def one_line(kind, value):
    if isinstance(value, HeterogeneousConfigError):
        return f"deepspeed: {value}"
    return f"{kind.__name__}: {value}"


def report_line(rank, mine, posts, world_size):
    """What global rank ``rank`` prints, from its own post ``mine`` and every rank's ``posts``
    ({rank: post}); ``"traceback"`` for Python's report; None for nothing. A post is a dict: ``kind``,
    ``message``, ``consequence`` (a broken collective), ``line`` (its one-line form) and ``fork``
    (one of the fork's errors)."""
    roots = {r: p for r, p in posts.items() if not p["consequence"]}
    if mine["consequence"]:
        if roots:
            first = min(roots)
            return (f"deepspeed-hetero: global rank {rank} stopped because global rank {first} failed "
                    f"({roots[first]['kind']}; its message is printed by that rank)")
        return "traceback"  # no peer says why: this rank's own report is all there is
    same = [r for r, p in roots.items() if (p["kind"], p["message"]) == (mine["kind"], mine["message"])]
    if min(same) != rank:
        return None  # a lower rank raised the same error and prints it
    if len(same) == world_size:
        return mine["line"] if mine["fork"] else "traceback"
    prefix = f"global rank {rank}" + (f" (and {sorted(set(same) - {rank})})" if len(same) > 1 else "")
    return f"{prefix}: {mine['line']}" if mine["fork"] else "traceback"


def _report(kind, value, tb, previous):
    import torch.distributed as dist
    post = {"kind": kind.__name__, "message": str(value), "consequence": is_consequence(value),
            "line": one_line(kind, value), "fork": is_fork_error(value)}
    store = _store() if dist.is_available() and dist.is_initialized() else None
    if store is None:
        if not post["fork"]:
            return previous(kind, value, tb)
        if os.environ.get("RANK", "0") == "0":
            print(post["line"], file=sys.stderr, flush=True)
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store.set(FAILURE_KEY.format(rank=rank), json.dumps(post))
    except Exception:  # noqa: BLE001 -- the store is gone (its host exited): report alone
        if not post["fork"]:
            return previous(kind, value, tb)
        print(f"global rank {rank}: {post['line']}", file=sys.stderr, flush=True)
        return None
    time.sleep(GRACE_S)
    posts = {rank: post}
    for other in range(world):
        key = FAILURE_KEY.format(rank=other)
        try:
            if other != rank and store.check([key]):
                posts[other] = json.loads(store.get(key))
        except Exception:  # noqa: BLE001 -- a peer's post that cannot be read counts as absent
            pass
    line = report_line(rank, post, posts, world)
    if line is None or post["consequence"]:
        # Launchers end every rank once one exits: the rank that prints the error goes first.
        time.sleep(GRACE_S)
    if line == "traceback":
        sys.stderr.write("".join(traceback_module.format_exception(kind, value, tb)))
    elif line is not None:
        print(line, file=sys.stderr, flush=True)
    if rank == 0:
        time.sleep(GRACE_S)  # the store lives here under the deepspeed launcher: let the others read it
    return None


def _store():
    try:
        from torch.distributed import distributed_c10d
        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- no torch.distributed group: report alone
        return None


def invalid_json_message(path, error):
    """The one line for a ds_config file at ``path`` that does not parse (``error``: hjson's or
    json's, whose text gives the line and column)."""
    return f"config {path} is not valid JSON: {error}"


@contextlib.contextmanager
def config_file_errors(path):
    """Around upstream's reading of the ds_config file at ``path`` (``DeepSpeedConfig``): a syntax
    error becomes a ``HeterogeneousConfigError`` (``invalid_json_message``) that ends the job with
    one line. Whether or not the fork is enabled: a file that does not parse cannot say."""
    import hjson
    try:
        yield
    except hjson.HjsonDecodeError as exc:
        one_line_config_errors()
        raise HeterogeneousConfigError(invalid_json_message(path, exc)) from None
