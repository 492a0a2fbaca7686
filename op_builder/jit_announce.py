# SPDX-License-Identifier: Apache-2.0
"""Say on stderr that an op is being JIT-built, before torch's ``load()`` starts the build.

``load()`` compiles an extension silently when no build of it exists yet or a source is newer than
the build: minutes on a small machine without a word. ``OpBuilder.jit_load`` in both copies of
upstream's op builders (``op_builder/builder.py``, ``deepspeed/ops/op_builder/builder.py``; see
op-builder-announce-jit-build.patch) calls ``announce_jit_build`` first. It imports torch only when
called and nothing of the fork, so either copy of ``op_builder`` can import it.
"""

import os
import sys


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
        built = os.path.join(_get_build_directory(name, verbose=False), name + LIB_EXT)
        if os.path.exists(built) and all(os.path.getmtime(src) <= os.path.getmtime(built) for src in sources):
            return False
    except OSError:
        return False
    print(f"DeepSpeed: building op '{name}' (JIT, first use; later runs load the cached build from "
          f"{os.path.dirname(built)}): this can take a few minutes...",
          file=sys.stderr if file is None else file,
          flush=True)
    return True
