"""The environment ``make install`` sets up builds each native op once, from one copy of its sources.

- Every process of the venv, whatever PYTHONPATH says, compiles an op from the same source files,
  so that torch's JIT cache (ninja's build file holds absolute paths) is never invalidated by a
  process that saw the other copy the sdist ships (``op_builder/`` + ``csrc/`` and
  ``deepspeed/ops/op_builder/`` + ``deepspeed/ops/csrc/``).
- A JIT build announces itself once, and a cached build loads silently.
"""

import json
import os
import subprocess
import sys

import pytest

from harness import REPO_ROOT

# What jit_load hands torch's load(): the builder's module and the absolute source and include
# paths, for upstream's CPU ops the tests and the demo build and for the fork's own op.
RESOLVE_SOURCES_CODE = """
import json, os
from deepspeed.accelerator import get_accelerator
resolved = {}
for name in ("ShareMemCommBuilder", "FusedAdamBuilder", "HeterogeneousBuilder"):
    builder = get_accelerator().create_op_builder(name)
    builder.jit_mode = True
    paths = [builder.sources(), builder.include_paths()]
    resolved[name] = {"module": type(builder).__module__,
                      "paths": [[os.path.abspath(builder.deepspeed_src_path(p)) for p in group] for group in paths]}
print(json.dumps(resolved))
"""

LOAD_NATIVE_OP_CODE = """
from deepspeed.runtime.heterogeneous.measure.native import load_native_op, native_op_status
assert load_native_op() is not None, native_op_status()
"""

BUILD_NOTICE = "DeepSpeed: building op 'heterogeneous'"


def _run(code, cwd, **variables):
    """Run ``code`` with the venv's python; a variable set to None is removed from the environment."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_op_sources_resolve_to_one_copy_whatever_pythonpath_says(tmp_path):
    # A working directory outside the tree, so that only the environment decides what is found.
    with_root = _run(RESOLVE_SOURCES_CODE, tmp_path, PYTHONPATH=str(REPO_ROOT))
    without = _run(RESOLVE_SOURCES_CODE, tmp_path, PYTHONPATH=None)
    resolved_with = json.loads(with_root.stdout.strip().splitlines()[-1])
    resolved_without = json.loads(without.stdout.strip().splitlines()[-1])
    assert resolved_without == resolved_with
    for name, resolved in resolved_with.items():
        assert resolved["module"].startswith("op_builder."), (name, resolved["module"])
        assert all(path.startswith(str(REPO_ROOT)) for group in resolved["paths"] for path in group), name


@pytest.mark.multiprocess
@pytest.mark.timeout(1800)
def test_a_jit_build_is_announced_once_and_a_cached_build_loads_silently(tmp_path):
    extensions_dir = str(tmp_path / "torch_extensions")
    first = _run(LOAD_NATIVE_OP_CODE, tmp_path, TORCH_EXTENSIONS_DIR=extensions_dir)
    assert (first.stdout + first.stderr).count(BUILD_NOTICE) == 1, first.stderr[-3000:]
    second = _run(LOAD_NATIVE_OP_CODE, tmp_path, TORCH_EXTENSIONS_DIR=extensions_dir)
    assert BUILD_NOTICE not in second.stdout + second.stderr
