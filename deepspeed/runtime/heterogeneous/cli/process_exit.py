# SPDX-License-Identifier: Apache-2.0
"""End a distributed training process once its work is done, without interpreter finalization."""

import atexit
import os
import sys


def end_process(code=0):
    """Destroy the process groups, run the atexit handlers (the fork's cgroup cleanup among them),
    flush, and leave with ``os._exit(code)``.

    Interpreter finalization is skipped on purpose. gloo's worker threads can still hold async
    work objects whose tensors need the GIL to be freed; freed while the interpreter is torn down,
    they abort the process ("terminate called without an active exception", exit -6) after all of
    its work was done. ``destroy_process_group`` before a normal exit makes that rarer, not
    impossible: a launcher-run rank can still abort there, and the launcher then reports the whole
    job as failed.
    """
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
