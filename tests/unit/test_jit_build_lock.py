"""A JIT build lock that no process holds any more: torch waits on it without end, also when the op
is built. The fork says so before a load; the harness removes such locks from its own directory."""

import contextlib
import io
import os
import time

from harness import clear_stale_build_locks
from op_builder.jit_announce import STALE_LOCK_AGE_S, announce_jit_build, stale_build_lock


def _build_dir(root, name, age_s, lock=True):
    """A build directory like torch's, every file ``age_s`` seconds old."""
    directory = root / name
    directory.mkdir()
    names = ["build.ninja", "a.o"] + (["lock"] if lock else [])
    then = time.time() - age_s
    for file in names:
        (directory / file).write_text("")
        os.utime(directory / file, (then, then))
    return directory


@contextlib.contextmanager
def _holding(lock):
    """Hold a lock file open, as torch's builder does from taking the lock to the build's end."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        yield
    finally:
        os.close(fd)


def test_a_lock_is_stale_only_when_nothing_holds_it_and_its_directory_is_quiet(tmp_path):
    old = STALE_LOCK_AGE_S + 30
    stale = _build_dir(tmp_path, "stale", old)
    assert stale_build_lock(str(stale)) == str(stale / "lock")
    # A build that just took the lock, or one still writing objects.
    assert stale_build_lock(str(_build_dir(tmp_path, "fresh", 1))) is None
    writing = _build_dir(tmp_path, "writing", old)
    (writing / "b.o").write_text("")
    assert stale_build_lock(str(writing)) is None
    # The building process holds the lock however long an object takes.
    busy = _build_dir(tmp_path, "busy", old)
    with _holding(busy / "lock"):
        assert stale_build_lock(str(busy)) is None
    assert stale_build_lock(str(busy)) == str(busy / "lock")
    assert stale_build_lock(str(_build_dir(tmp_path, "unlocked", old, lock=False))) is None
    assert stale_build_lock(str(tmp_path / "missing")) is None
    # Known dead holders: no quiet time needed.
    assert stale_build_lock(str(tmp_path / "fresh"), min_age_s=0) == str(tmp_path / "fresh" / "lock")


def test_harness_removes_only_the_stale_locks_of_its_directory(tmp_path):
    old = STALE_LOCK_AGE_S + 30
    for name in ("stale", "busy"):
        _build_dir(tmp_path, name, old)
    _build_dir(tmp_path, "fresh", 1)
    with _holding(tmp_path / "busy" / "lock"):
        line = clear_stale_build_locks(str(tmp_path))
        assert str(tmp_path / "stale" / "lock") in line, line
        assert sorted(p.parent.name for p in tmp_path.glob("*/lock")) == ["busy", "fresh"]
        assert clear_stale_build_locks(str(tmp_path)) == ""
        # After the group's processes were killed: the fresh lock goes, the one still held stays.
        clear_stale_build_locks(str(tmp_path), min_age_s=0)
        assert [p.parent.name for p in tmp_path.glob("*/lock")] == ["busy"]
    assert clear_stale_build_locks(None) == ""


def test_loading_through_a_stale_lock_names_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = _build_dir(tmp_path, "some_op", STALE_LOCK_AGE_S + 30)
    out = io.StringIO()
    # Not built yet: the build is announced too.
    assert announce_jit_build("some_op", [], file=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert f"torch will wait for the build lock {directory / 'lock'}, which no process on this host holds" in lines[0]
    assert "delete it" in lines[0] and "building op 'some_op'" in lines[1]
    (directory / "lock").unlink()
    out = io.StringIO()
    announce_jit_build("some_op", [], file=out)
    assert "lock" not in out.getvalue()
