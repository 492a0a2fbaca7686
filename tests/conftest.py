"""Session set-up shared by deepspeed-hetero's tests.

- Makes ``tests/unit/harness.py`` importable as ``harness`` from every test directory.
- Points this process's JIT builds at the test ranks' extensions directory.
- Registers the ``multiprocess`` marker: tests that spawn ranks or run the ``deepspeed``
  launcher take seconds each; ``pytest -m "not multiprocess"`` leaves them out.
- Builds the shared-memory comm op once per session before any multi-process test runs.
- Provides ``pristine_upstream``: the pinned upstream DeepSpeed, unpacked from the sdist the
  patch set is built on, for parity tests against the unpatched release.
"""

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# pytest puts only a test file's own directory on sys.path; tests in sub-directories need this.
HARNESS_DIR = Path(__file__).resolve().parent / "unit"
if str(HARNESS_DIR) not in sys.path:
    sys.path.insert(0, str(HARNESS_DIR))

import harness  # noqa: E402

# In-process JIT builds (the native op a measured device score loads) go where the test ranks
# build theirs: one build per machine, shared, and nothing written to the user's own
# ~/.cache/torch_extensions.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", harness.fork_environment()["TORCH_EXTENSIONS_DIR"])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multiprocess: spawns ranks or runs the deepspeed launcher (seconds per test); "
        "deselect with -m 'not multiprocess'")
    if not config.pluginmanager.hasplugin("timeout"):
        # Without pytest-timeout the tests' backstop time-outs are inert, not unknown marks.
        config.addinivalue_line("markers", "timeout(seconds): pytest-timeout's limit; inert without the plugin")


@pytest.fixture(scope="session", autouse=True)
def shm_comm_op_built(request):
    """Build the shm comm op once, only in sessions that run multi-process tests.

    A cold build takes minutes on two cores and counts towards the first test's pytest-timeout;
    afterwards this costs one ``import deepspeed`` in a subprocess.
    """
    if any(item.get_closest_marker("multiprocess") for item in request.session.items):
        try:
            harness.warm_shm_comm_op()
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)


@dataclass(frozen=True)
class PristineUpstream:
    """An unpacked, unpatched upstream DeepSpeed and how to run Python against it."""

    version: str
    root: Path  # holds the ``deepspeed`` package; use as working directory too
    env: dict  # PYTHONPATH to the tree, TORCH_EXTENSIONS_DIR of its own


def _unpack_pristine(patchset, files, tree):
    """Make ``tree`` hold exactly the bytes of ``files``, writing only what is missing or differs.

    Unchanged files keep their modification times, so that ninja does not rebuild the JIT ops.
    """
    if not tree.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=tree.parent))
        patchset.write_tree(files, staging)
        try:
            # One rename, so that a concurrent session never sees half a tree.
            staging.rename(tree)
        except OSError:  # another session put its copy there first
            shutil.rmtree(staging, ignore_errors=True)
    stale = {rel: value for rel, value in files.items()
             if not (tree / rel).is_file() or (tree / rel).read_bytes() != value[0]}
    patchset.write_tree(stale, tree)


@pytest.fixture(scope="session")
def pristine_upstream():
    """The pinned upstream release, unpacked and with its shm comm op built.

    The tree lives at a stable path in the sdist cache (``DS_HETERO_CACHE``, default
    ``~/.cache/deepspeed-hetero``) rather than in a per-session temporary directory: torch's JIT
    build is keyed on absolute source paths, so a new path would rebuild the op (minutes on two
    cores) every session. Its builds go to a TORCH_EXTENSIONS_DIR of its own because the fork's
    op has the same name. The tree is compared with the sdist each session, and files that
    differ are restored.
    """
    patchset = harness.load_patchset()
    pin = patchset.read_pin()
    base = patchset.cache_dir() / f"upstream-{pin['version']}-{pin['sdist_sha256'][:12]}"
    base.mkdir(parents=True, exist_ok=True)
    tree = base / "tree"
    _unpack_pristine(patchset, patchset.pristine_tree(pin), tree)
    upstream = PristineUpstream(pin["version"], tree, {
        "PYTHONPATH": str(tree),
        "TORCH_EXTENSIONS_DIR": str(base / "torch_extensions"),
    })
    try:
        harness.warm_shm_comm_op(env=upstream.env, cwd=tree)
    except RuntimeError as exc:
        pytest.fail(f"pristine upstream {pin['version']} at {tree}: {exc}", pytrace=False)
    return upstream
