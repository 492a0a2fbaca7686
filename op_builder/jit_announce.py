# SPDX-License-Identifier: Apache-2.0
"""Say on stderr that an op is being JIT-built, before torch's ``load()`` starts the build.

``load()`` compiles an extension silently when no build of it exists yet or a source is newer than
the build: minutes on a small machine without a word. ``OpBuilder.jit_load`` in both copies of
upstream's op builders (``op_builder/builder.py``, ``deepspeed/ops/op_builder/builder.py``; see
op-builder-announce-jit-build.patch) calls ``announce_jit_build`` first. It imports torch only when
called and nothing of the fork, so either copy of ``op_builder`` can import it.

torch guards a build directory with a ``lock`` file and waits, without a word and without end, for
it to go away, also when the build is cached. A process killed while it built leaves that file
behind, and every later load of the op hangs. ``announce_jit_build`` says so when it finds such a
lock (``stale_build_lock``); the test harness removes them from its own build directory.
"""

import os
import sys
import time

# Seconds without a change in a build directory after which a lock no process here holds is not a
# build on another host that shares the directory (see stale_build_lock).
STALE_LOCK_AGE_S = 60.0


def announce_jit_build(name, sources, file=None):
    """Print, once before the build starts, that op ``name`` is being JIT-built and where later runs
    find the cached build; print nothing when torch would load a cached build of it.

    Args:
        name: the op's name (torch's extension name).
        sources: absolute paths of the op's sources; a build older than any of them is rebuilt.
        file: where to print (default None: sys.stderr at call time).

    Returns True when it announced a build. A change only to a header or to compiler flags also
    rebuilds, unannounced: torch decides that inside ``load()``.
    """
    # torch's build directory and file name: <name><LIB_EXT>, version 0 in a new process.
    from torch.utils.cpp_extension import _get_build_directory, LIB_EXT
    try:
        build_dir = _get_build_directory(name, verbose=False)
        lock = stale_build_lock(build_dir)
        if lock is not None:
            print(f"DeepSpeed: op '{name}': torch will wait for the build lock {lock}, which no process on this "
                  f"host holds (a process killed while it built the op leaves it); unless another host is "
                  f"building into this directory, delete it",
                  file=sys.stderr if file is None else file,
                  flush=True)
        built = os.path.join(build_dir, name + LIB_EXT)
        if os.path.exists(built) and all(os.path.getmtime(src) <= os.path.getmtime(built) for src in sources):
            return False
    except OSError:
        return False
    print(f"DeepSpeed: building op '{name}' (JIT, first use; later runs load the cached build from "
          f"{os.path.dirname(built)}): this can take a few minutes...",
          file=sys.stderr if file is None else file,
          flush=True)
    return True


def lock_holders(paths):
    """{path: pids that hold it open}, or None where this system cannot tell (no /proc).

    torch's lock (FileBaton) keeps the lock file's descriptor open from acquiring it to the end
    of the build, in the Python process that builds; a lock nobody holds is left by a process
    that died. Processes on other machines (a lock on a shared file system) are not seen.
    """
    if not os.path.isdir("/proc/self/fd"):
        return None
    wanted = {os.path.realpath(path): path for path in paths}
    holders = {path: [] for path in paths}
    if not wanted:
        return holders
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone meanwhile, or another user's
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target in wanted:
                holders[wanted[target]].append(int(pid))
    return holders


def stale_build_lock(build_dir, min_age_s=STALE_LOCK_AGE_S, now=None):
    """The path of torch's build lock in ``build_dir`` when no process on this host holds it and
    nothing in the directory changed for ``min_age_s`` seconds, else None.

    The quiet time keeps a build on another host that shares the directory (invisible here, but
    writing an object file every few seconds to minutes) from counting as dead; callers only say
    what they found, or act on directories of their own.
    """
    lock = os.path.join(build_dir, "lock")
    now = time.time() if now is None else now
    try:
        newest = max(os.path.getmtime(os.path.join(build_dir, entry)) for entry in os.listdir(build_dir))
        if not os.path.exists(lock) or now - newest < min_age_s:
            return None
    except (OSError, ValueError):  # no directory, or it changed while read
        return None
    holders = lock_holders([lock])
    return lock if holders is not None and not holders[lock] else None
