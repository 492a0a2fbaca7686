# SPDX-License-Identifier: Apache-2.0
"""The patch-set machinery: assembly, export, check and the packages, on copies of the checkout.

The real checkout is never modified: workflow tests run in a temporary git repository holding a
copy of the fork's tracked files, assembled there from the cached sdist.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_patchset(root=REPO):
    spec = importlib.util.spec_from_file_location(f"patchset_{abs(hash(str(root)))}", root / "scripts" / "patchset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


patchset = load_patchset()


def git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def pristine():
    return patchset.pristine_tree(patchset.read_pin())


@pytest.fixture
def checkout(tmp_path):
    """A fresh git repository with the fork's tracked files as they are in this working tree."""
    root = tmp_path / "fork"
    root.mkdir()
    for rel in patchset.fork_tracked_files():
        source = REPO / rel
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        elif source.is_file():
            shutil.copy2(source, target)
    git("init", "-q", cwd=root)
    git("add", "-A", cwd=root)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "fork", cwd=root)
    return root


def tool(root, *args, env=None):
    proc = subprocess.run([sys.executable, str(root / "scripts" / "patchset.py"), *args], cwd=root,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout + proc.stderr


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


def test_series_and_patches_are_well_formed():
    assert patchset.check_series_folder() == []
    for name in patchset.read_series():
        meta = patchset.parse_patch((patchset.PATCH_DIR / name).read_text())
        assert meta.trailers().get("Origin") in ("vendor", "backport", "upstream")
        assert meta.description()


def test_export_is_canonical_and_deterministic(pristine):
    expected = patchset.expected_tree(patchset.read_pin(), pristine)
    metas = patchset.load_series_meta()
    stages = patchset.stacked_stages(pristine, metas, patchset.ownership(metas)[1])
    for name, meta in metas.items():
        first = patchset.render_patch(meta, pristine, expected, sorted(meta.owned), stages, name)
        again = patchset.render_patch(patchset.parse_patch(first), pristine, expected, sorted(meta.owned), stages, name)
        assert first == again == (patchset.PATCH_DIR / name).read_text(), name


def test_combined_patch_turns_pristine_upstream_into_the_assembled_tree(tmp_path, pristine):
    """`git apply` of the dist patch onto pristine upstream in a temporary repository gives, file
    for file, what this checkout holds (upstream files patched, the fork's own files added), and
    reports no whitespace errors."""
    pin = patchset.read_pin()
    _, patch = patchset.combined_patch(pin, pristine, patchset.assembled_tree(pin))
    work = tmp_path / "upstream"
    work.mkdir()
    patchset.write_tree(pristine, work)
    git("init", "-q", cwd=work)
    (tmp_path / "fork.patch").write_text(patch)
    # Without a single whitespace warning: a user's git may be configured to refuse them.
    git("apply", "--whitespace=error-all", str(tmp_path / "fork.patch"), cwd=work)
    produced = [p for p in work.rglob("*") if (p.is_file() or p.is_symlink()) and ".git" not in p.parts]
    assert len(produced) == len(pristine) + len(
        [p for p in patchset.fork_tracked_files() if p not in pristine]), "file count differs"
    for path in produced:
        rel = path.relative_to(work).as_posix()
        ours = REPO / rel
        if path.is_symlink():
            assert os.readlink(path) == os.readlink(ours), rel
        else:
            assert path.read_bytes() == ours.read_bytes(), rel
            assert bool(path.stat().st_mode & 0o111) == bool(ours.stat().st_mode & 0o111), rel


def test_source_archive_installs_layout(pristine):
    pin = patchset.read_pin()
    name, archive = patchset.source_archive(pin, patchset.dereference(patchset.assembled_tree(pin)))
    assert name == f"deepspeed-{patchset.fork_version(pin)}.tar.gz"
    tree = patchset.read_archive(archive)
    assert "setup.py" in tree and "UPSTREAM" in tree
    # The in-tree links to csrc/ and op_builder/ arrive as real files with the same bytes.
    linked = "deepspeed/ops/csrc/heterogeneous/heterogeneous.cpp"
    assert tree[linked][0] == (REPO / "csrc/heterogeneous/heterogeneous.cpp").read_bytes()
    assert patchset.source_archive(pin, patchset.dereference(patchset.assembled_tree(pin)))[1] == archive


def test_workflow_tree_edit_check_export(checkout):
    code, out = tool(checkout, "tree")
    assert code == 0, out
    before = snapshot(checkout)
    code, out = tool(checkout, "tree")
    assert code == 0 and snapshot(checkout) == before, "a second 'make tree' must change nothing"
    assert "/setup.py" in (checkout / ".git/info/exclude").read_text()
    assert git("status", "--porcelain", cwd=checkout) == "", "upstream files must not show as untracked"
    assert tool(checkout, "check")[0] == 0

    # An unexported edit of an upstream file is caught by name.
    config = checkout / "deepspeed/runtime/config.py"
    config.write_text(config.read_text() + "\n# an edit\n")
    code, out = tool(checkout, "check")
    assert code == 2 and "deepspeed/runtime/config.py" in out and "unexported" in out
    # 'make tree' keeps local edits instead of overwriting them.
    assert tool(checkout, "tree")[0] == 0 and config.read_text().endswith("# an edit\n")

    # Export puts it into the patch that owns the file; then the check passes again.
    code, out = tool(checkout, "export")
    assert code == 0 and "config-heterogeneous-blocks.patch" in out
    assert "+# an edit" in (checkout / "patches/config-heterogeneous-blocks.patch").read_text()
    assert tool(checkout, "check")[0] == 0

    # An edit of a file no patch owns must be assigned; 'new' creates and registers the patch.
    runner_doc = checkout / "deepspeed/utils/timer.py"
    runner_doc.write_text(runner_doc.read_text() + "\n# another edit\n")
    code, out = tool(checkout, "export")
    assert code == 2 and "without a patch: deepspeed/utils/timer.py" in out
    code, out = tool(checkout, "new", "timer-note.patch", "deepspeed/utils/timer.py", "--why",
                     "timer: a note\n\nWhy: to test the workflow.")
    assert code == 0, out
    assert (checkout / "patches/series").read_text().splitlines()[-1] == "timer-note.patch"
    assert tool(checkout, "check")[0] == 0

    # An edit of one sdist copy is mirrored into the other.
    builder = checkout / "op_builder/cpu/__init__.py"
    builder.write_text(builder.read_text() + "# mirrored\n")
    assert tool(checkout, "export")[0] == 0
    assert (checkout / "deepspeed/ops/op_builder/cpu/__init__.py").read_text().endswith("# mirrored\n")
    assert tool(checkout, "check")[0] == 0


def test_series_problems_are_reported(checkout):
    assert tool(checkout, "tree")[0] == 0
    series = checkout / "patches/series"
    names = series.read_text().splitlines()
    series.write_text("\n".join(names + [names[0]]) + "\n")
    (checkout / "patches/stray.patch").write_text("Subject: x\n")
    code, out = tool(checkout, "check")
    assert code == 2
    assert f"lists {names[0]} twice" in out
    assert "patches/stray.patch is not listed in patches/series" in out


def test_patch_without_description_or_trailers_fails(checkout):
    assert tool(checkout, "tree")[0] == 0
    name = patchset.read_series()[0]
    path = checkout / "patches" / name
    text = path.read_text()
    head, diff = text.split("\ndiff --git ", 1)
    subject = next(line for line in head.splitlines() if line.startswith("Subject:"))
    path.write_text(head.split("Subject:")[0] + subject + "\n\n---\ndiff --git " + diff)
    code, out = tool(checkout, "check")
    assert code == 2 and f"patches/{name} lacks a description" in out and "trailer(s) Origin, Forwarded" in out


def test_patch_that_no_longer_applies_names_itself_and_leaves_the_tree(checkout):
    assert tool(checkout, "tree")[0] == 0
    name = patchset.read_series()[0]
    path = checkout / "patches" / name
    lines = path.read_text().splitlines(keepends=True)
    first_hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    context = next(i for i in range(first_hunk, len(lines)) if lines[i].startswith(" ") and len(lines[i].strip()) > 3)
    lines[context] = " something upstream never had\n"
    path.write_text("".join(lines))
    before = snapshot(checkout)
    code, out = tool(checkout, "tree")
    assert code == 2 and f"patches/{name} does not apply to pristine upstream" in out
    assert "\n" not in out.strip(), "one line"
    after = snapshot(checkout)
    assert before == after


def test_corrupt_sdist_is_refused(tmp_path, checkout):
    cache = tmp_path / "cache"
    cache.mkdir()
    pin = patchset.read_pin()
    (cache / f"deepspeed-{pin['version']}.tar.gz").write_bytes(b"not a tarball")
    code, out = tool(checkout, "tree", env={"DS_HETERO_CACHE": str(cache)})
    assert code == 2 and "corrupt or not the pinned release" in out and pin["sdist_sha256"] in out
    assert not (checkout / "setup.py").exists(), "nothing may be unpacked from a bad sdist"


def test_missing_git_is_one_line(checkout, tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = subprocess.run([sys.executable, str(checkout / "scripts/patchset.py"), "tree"], cwd=checkout,
                          capture_output=True, text=True, env={**os.environ, "PATH": str(empty)})
    assert proc.returncode == 2
    assert "'git' not found on PATH" in proc.stderr and "Traceback" not in proc.stderr


def test_dist_writes_both_artifacts(checkout):
    assert tool(checkout, "tree")[0] == 0
    code, out = tool(checkout, "dist")
    assert code == 0, out
    version = patchset.fork_version(patchset.read_pin())
    archive = checkout / "dist" / f"deepspeed-{version}.tar.gz"
    with tarfile.open(archive) as tar:
        assert f"deepspeed-{version}/setup.py" in tar.getnames()
    assert (checkout / "dist" / f"deepspeed-hetero-{version}.patch").read_text().startswith("From 0000000")


def test_stacked_file_keeps_the_earlier_patch_as_written(checkout):
    """engine.py is changed by fp16-zero0-loss-scaling.patch (an upstream bug fix kept apart, named
    in its Stacked-files trailer), by the stacked patches after it, and last by the series' last
    patch that changes it, which owns new edits."""
    assert tool(checkout, "tree")[0] == 0
    fix = checkout / "patches/fp16-zero0-loss-scaling.patch"
    owner = [name for name in (checkout / "patches/series").read_text().split()
             if "a/deepspeed/runtime/engine.py " in (checkout / "patches" / name).read_text()][-1]
    hooks = checkout / "patches" / owner
    fix_before = fix.read_text()
    assert "Stacked-files: deepspeed/runtime/engine.py" in fix_before
    engine = checkout / "deepspeed/runtime/engine.py"
    engine.write_text(engine.read_text() + "\n# a later edit\n")
    code, out = tool(checkout, "export")
    assert code == 0 and f"rewritten: {owner}" in out, out
    assert "+# a later edit" in hooks.read_text() and fix.read_text() == fix_before
    # The owner's diff starts where the fix leaves the file: the fix's lines are not in it.
    assert "_zero0_fp16_scale_loss" not in hooks.read_text() and "_zero0_fp16_scale_loss" in fix_before
    assert tool(checkout, "check")[0] == 0

    # Without the trailer the same overlap is refused, naming both patches.
    fix.write_text(fix_before.replace("Stacked-files: deepspeed/runtime/engine.py\n", ""))
    code, out = tool(checkout, "check")
    assert code == 2 and "changed by both fp16-zero0-loss-scaling.patch and engine-heterogeneous-loss-weight.patch" in out


def test_a_patch_over_the_size_limit_fails_the_check(tmp_path, monkeypatch):
    diff = "".join(f"+line {i}\n" for i in range(patchset.MAX_CHANGED_LINES + 1))
    header = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -0,0 +1,61 @@\n"
    (tmp_path / "big.patch").write_text("Subject: big\n\n" + header + diff)
    (tmp_path / "small.patch").write_text("Subject: small\n\n" + header + "-old\n+new\n")
    monkeypatch.setattr(patchset, "PATCH_DIR", tmp_path)
    assert patchset.changed_lines((tmp_path / "small.patch").read_text()) == 2  # file headers do not count
    problems, sizes, median = patchset.check_patch_sizes(["big.patch", "small.patch"])
    assert sizes == {"big.patch": 61, "small.patch": 2} and median == 31.5
    assert len(problems) == 2 and "big.patch changes 61 lines" in problems[0] and "median" in problems[1]
    assert patchset.check_patch_sizes(["small.patch"])[0] == []
