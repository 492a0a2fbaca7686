# SPDX-License-Identifier: Apache-2.0
"""Checkpoints the engine takes by itself (``heterogeneous_config.elastic.checkpoint``).

A run restarted after a failure (``torchrun --max-restarts``, docs/elastic.md) resumes from the
newest complete checkpoint; what it redoes is the steps since. ``PeriodicCheckpoints.after_step``
runs once ``engine.step()`` has completed an optimizer step (a hook at the end of upstream's
``step``), on every rank:

- when to save is decided alike on every rank: by the step count, or by the slowest rank's time
  since the last save, gathered at a few step boundaries (``next_time_check`` spaces the gathers
  from the gathered times, so they are the same everywhere). A rank-local clock must never decide:
  a rank alone in ``save_checkpoint`` would wait for the others forever;
- ``save_checkpoint(dir, tag="global_step<N>.partial", save_latest=False)`` into a folder cleared
  first, a barrier, then global rank 0 renames it to ``global_step<N>`` (replacing an earlier save
  of that name), writes ``latest`` (to a temporary file, renamed) and removes tags beyond
  ``keep_last``. Upstream saves into a folder that may hold another save's files: a rank dying
  midway would leave a tag mixing two saves (``latest`` waits for every rank in any save,
  ``integrity.publish_latest``).

Saves are synchronous. Upstream's decoupled writer (``checkpoint.writer.decoupled``) is refused with
them: it writes after ``save_checkpoint`` returns, and in 0.19.8 it fails on a ZeRO-1/2 state on
this machine with upstream alone ("Cowardly refusing to serialize non-leaf tensor which
requires_grad"), so publishing ``latest`` after its commit could not be tested.
"""

import os
import re
import shutil
import time

from deepspeed import comm as dist
from deepspeed.utils import logger

from .integrity import write_latest
from .resize import UNIVERSAL_SUFFIX

TAG_PREFIX = "global_step"
_TAG = re.compile(rf"^{TAG_PREFIX}(\d+)$")


def next_time_check(elapsed, steps, every_seconds):
    """Steps until the next time check, from the slowest rank's ``elapsed`` seconds over ``steps``
    steps since the last save: half the steps the rest of the period is expected to take, at least
    one. The same inputs on every rank give the same answer."""
    if steps <= 0 or elapsed <= 0:
        return 1
    per_step = elapsed / steps
    return max(1, int((every_seconds - elapsed) / per_step / 2))


def tags_to_remove(names, keep_last, latest):
    """The tags among ``names`` (a folder's entries) beyond the newest ``keep_last``, never the one
    ``latest`` names; 0 keeps all."""
    steps = sorted((int(m.group(1)), name) for name in names for m in [_TAG.match(name)] if m)
    if keep_last <= 0:
        return []
    old = [name for _, name in steps[:-keep_last]]
    return [name for name in old if name != latest]


SHARED_STORE_WARNING = (
    "deepspeed-hetero: this run may be restarted by torchrun (--max-restarts > 0) with the agents' shared "
    "rendezvous store, which keeps the previous round's keys: restarted workers then fail to form their process "
    "group (pytorch/pytorch#135712). Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
    "(docs/elastic.md)")


def shared_store_breaks_restarts(environ):
    """Whether this worker was started by a torchrun agent that may restart it and shares its store
    with the workers."""
    try:
        restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False
    return restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


class PeriodicCheckpoints:
    """One engine's periodic saves (``settings``: the ``PeriodicCheckpointConfig``)."""

    def __init__(self, settings, agreement):
        self.settings = settings
        self.agreement = agreement
        if shared_store_breaks_restarts(os.environ) and dist.get_rank() == 0:
            logger.warning(SHARED_STORE_WARNING)
        self.last_step = None  # the step of the last save (or of the first step seen)
        self.last_time = None
        self.next_check = None

    def restart_clock(self, step):
        self.last_step, self.last_time, self.next_check = step, time.perf_counter(), None

    def after_step(self, engine):
        """Save when a checkpoint is due after the step ``engine`` just completed; whether it saved."""
        step = engine.global_steps
        if self.last_step is None and engine.checkpoint_engine.is_decoupled():  # the same on every rank
            raise ValueError("heterogeneous_config.elastic.checkpoint saves synchronously and publishes 'latest' once "
                             "every rank wrote its files; it cannot be used with checkpoint.writer.decoupled: true, "
                             "whose writes finish later. Drop one of them")
        if self.last_step is None or step < self.last_step:  # the first step, or a checkpoint loaded
            self.restart_clock(step - 1)
        if not self._due(step):
            return False
        self.save(engine, step)
        return True

    def _due(self, step):
        every_steps, every_seconds = self.settings.every_steps, self.settings.every_seconds
        if every_steps and step % every_steps == 0:
            return True
        if not every_seconds:
            return False
        if self.next_check is not None and step < self.next_check:
            return False
        elapsed = max(self.agreement.gather_from_every_rank(time.perf_counter() - self.last_time,
                                                            "the time since the last periodic checkpoint"))
        if elapsed >= every_seconds:
            return True
        self.next_check = step + next_time_check(elapsed, step - self.last_step, every_seconds)
        return False

    def save(self, engine, step):
        """Save under a temporary tag, cleared first, and rename it to ``global_step<N>`` once every
        rank has written: a tag folder is never a mix of two saves (a torn save on a larger world
        leaves no files of ranks that are gone, a save under a reused name no files of the old one)."""
        folder = self.settings.dir
        tag = f"{TAG_PREFIX}{step}"
        partial = f"{tag}{PARTIAL_SUFFIX}"
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(folder, partial), ignore_errors=True)
        self.agreement.barrier(f"checkpoint {tag}'s folder to be cleared")
        engine.save_checkpoint(folder, tag=partial, save_latest=False)
        self.restart_clock(step)
        self.agreement.barrier(f"every rank's files of checkpoint {tag}")
        if dist.get_rank() != 0:
            return
        publish_tag(folder, partial, tag)
        write_latest(folder, tag)
        for old in tags_to_remove(os.listdir(folder), self.settings.keep_last, tag):
            shutil.rmtree(os.path.join(folder, old), ignore_errors=True)
            shutil.rmtree(os.path.join(folder, old + UNIVERSAL_SUFFIX), ignore_errors=True)


PARTIAL_SUFFIX = ".partial"
"""A periodic save's folder until every rank has written it (``tags_to_remove`` never matches it)."""


def publish_tag(folder, partial, tag):
    """Rename the complete save ``partial`` to ``tag``, replacing an earlier save of that name and its
    universal conversion."""
    final = os.path.join(folder, tag)
    if os.path.exists(final):
        retired = f"{final}.replaced-{os.getpid()}"
        os.replace(final, retired)
        shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(final + UNIVERSAL_SUFFIX, ignore_errors=True)
    os.replace(os.path.join(folder, partial), final)
