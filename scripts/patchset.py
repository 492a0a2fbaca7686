#!/usr/bin/env python3
"""Patch-set machinery of deepspeed-hetero: assemble, export, check, package.

The repository holds only the fork's own files plus ``patches/``; upstream DeepSpeed arrives
from the sdist pinned in ``UPSTREAM`` and is unpacked *into the repository root*.

Commands (the Makefile wraps them):
  tree     fetch + verify the sdist, unpack it into the root, apply patches/series
  export   regenerate patches/*.patch from the edited upstream files
  new      start a new patch that owns some edited upstream files
  check    fail on anything that would lose work or break a build
  dist     write the source archive and the combined git-apply patch into dist/

Ownership rule: every edited upstream file belongs to exactly one patch, the patch whose diff
already touches it (``new`` assigns files to a new patch). The sdist carries three copies of
upstream trees (``op_builder/`` and ``deepspeed/ops/op_builder/``, ``accelerator/`` and
``deepspeed/accelerator/``, ``csrc/`` and ``deepspeed/ops/csrc/``); ``export`` mirrors an edit
of one copy into the other so they never drift.
"""

import argparse
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
SERIES = PATCH_DIR / "series"
GIT_DIR_STATE = "hetero"  # under .git/: manifest of what `make tree` wrote
EXCLUDE_BEGIN = "# >>> deepspeed-hetero: upstream files (written by make tree) >>>"
EXCLUDE_END = "# <<< deepspeed-hetero <<<"

# Files of the sdist that are packaging output, not source: setup.py rewrites them.
SDIST_METADATA_PREFIXES = ("PKG-INFO", "deepspeed.egg-info/", "deepspeed/git_version_info_installed.py")
# The sdist dereferences upstream's symlinks into copies; an edit of one copy is mirrored.
MIRRORS = (("op_builder/", "deepspeed/ops/op_builder/"), ("accelerator/", "deepspeed/accelerator/"),
           ("csrc/", "deepspeed/ops/csrc/"))
FIXED_AUTHOR = ("deepspeed-hetero developers", "deepspeed-hetero@users.noreply.invalid")
FIXED_DATE = "Wed, 1 Jan 2025 00:00:00 +0000"
FORMAT_PATCH_ARGS = ("--zero-commit", "--full-index", "--no-signature", "--no-stat", "--keep-subject", "-M",
                     "--no-color", "--stdout")
REQUIRED_TRAILERS = ("Origin", "Forwarded")
STACK_TRAILER = "Stacked-files"
# Thin patches (docs/contributing.md): the most changed lines one patch may have, and the most the median may be.
MAX_CHANGED_LINES = 60
MAX_MEDIAN_CHANGED_LINES = 20


class PatchSetError(Exception):
    """A failure the user can act on; printed as one line, exit status 2."""


def comm_patch_module():
    """scripts/comm_patch.py (patches/heterogeneous_comm_optimization.patch), loaded from beside
    this file: the tests load this module by its path, without scripts/ on sys.path."""
    spec = importlib.util.spec_from_file_location("deepspeed_hetero_comm_patch", Path(__file__).with_name(
        "comm_patch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def this_module():
    """This module's names as they are now, for comm_patch.py (loaded by path, this module may not
    be in sys.modules)."""
    import types
    return types.SimpleNamespace(**globals())


# ----------------------------------------------------------------------------------------------
# Pin, cache and tools


def read_pin():
    path = ROOT / "UPSTREAM"
    if not path.is_file():
        raise PatchSetError(f"{path} is missing: it pins the upstream release the fork is built on")
    pin = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            if not sep:
                raise PatchSetError(f"UPSTREAM: cannot parse line {line!r}; expected 'key = value'")
            pin[key.strip()] = value.strip()
    for key in ("name", "version", "sdist_sha256", "fork_revision"):
        if key not in pin:
            raise PatchSetError(f"UPSTREAM lacks '{key}'; it needs name, version, sdist_sha256, fork_revision")
    if not re.fullmatch(r"[0-9a-f]{64}", pin["sdist_sha256"]):
        raise PatchSetError("UPSTREAM sdist_sha256 must be 64 lowercase hex digits")
    if not pin["fork_revision"].isdigit():
        raise PatchSetError("UPSTREAM fork_revision must be a whole number (it restarts at 1 on each bump)")
    return pin


def fork_version(pin):
    return f"{pin['version']}+hetero.{pin['fork_revision']}"


def require_tool(name, why):
    if shutil.which(name) is None:
        raise PatchSetError(f"'{name}' not found on PATH; it is needed to {why}. Install it and re-run.")


def cache_dir():
    return Path(os.environ.get("DS_HETERO_CACHE", Path.home() / ".cache" / "deepspeed-hetero"))


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(pin):
    """Return the path of the pinned sdist, downloading it with pip into the cache if needed."""
    name = f"{pin['name']}-{pin['version']}.tar.gz"
    cached = cache_dir() / name
    if not cached.is_file():
        if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
            raise PatchSetError(f"pip is not available for {sys.executable}; it is needed to download the pinned "
                                f"upstream sdist (python -m ensurepip, or put the file at {cached})")
        cache_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            # --no-build-isolation: metadata preparation must not pull a (CUDA) torch.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", "--disable-pip-version-check", "-d", tmp,
                   f"{pin['name']}=={pin['version']}"]
            print(f"patchset: downloading {name} with pip into {cache_dir()}")
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not (Path(tmp) / name).is_file():
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                raise PatchSetError(f"pip could not download {name}: {tail[0]}; check the network or put the "
                                    f"file at {cached}")
            os.replace(Path(tmp) / name, cached)
    got = sha256_file(cached)
    if got != pin["sdist_sha256"]:
        raise PatchSetError(f"{cached} has sha256 {got} but UPSTREAM pins {pin['sdist_sha256']}: the file is "
                            f"corrupt or not the pinned release; delete it and re-run make tree")
    return cached


# ----------------------------------------------------------------------------------------------
# Trees as {path: (bytes, mode)} dictionaries


def is_sdist_metadata(path):
    return any(path == p or path.startswith(p) for p in SDIST_METADATA_PREFIXES)


def pristine_tree(pin):
    """Upstream's files as the sdist ships them, minus packaging metadata."""
    sdist = fetch_sdist(pin)
    top = f"{pin['name']}-{pin['version']}/"
    files = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith(top):
                    continue
                rel = member.name[len(top):]
                if not rel or is_sdist_metadata(rel):
                    continue
                mode = 0o755 if member.mode & 0o111 else 0o644
                files[rel] = (tar.extractfile(member).read(), mode)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise PatchSetError(f"cannot read {sdist}: {exc}; delete it and re-run make tree") from exc
    return files


def write_tree(files, dest):
    for rel, (data, mode) in files.items():
        path = Path(dest) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def read_tree(base, paths):
    files = {}
    for rel in paths:
        path = Path(base) / rel
        if path.is_file():
            files[rel] = (path.read_bytes(), 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
    return files


def read_series():
    if not SERIES.is_file():
        return []
    names = []
    for line in SERIES.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def git_apply(patch_path, workdir, what):
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch_path)], cwd=workdir,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["(no message)"])[0]
        raise PatchSetError(f"{what} does not apply to pristine upstream: {first}; rebase it (README, "
                            f"'Rebasing onto a new upstream')")


def expected_tree(pin, pristine=None):
    """Pristine upstream with patches/series applied, in order, by `git apply` (no fuzz)."""
    require_tool("git", "apply the patches")
    pristine = pristine_tree(pin) if pristine is None else pristine
    names = read_series()
    if not names:
        return dict(pristine)
    with tempfile.TemporaryDirectory() as tmp:
        write_tree(pristine, tmp)
        touched = set(pristine)
        for name in names:
            patch = PATCH_DIR / name
            if not patch.is_file():
                raise PatchSetError(f"patches/series lists {name} but patches/{name} does not exist")
            git_apply(patch, tmp, f"patches/{name}")
            touched |= {p for p, _ in parse_patch(patch.read_text()).files}
        return read_tree(tmp, sorted(touched))


def fork_tracked_files():
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        raise PatchSetError(f"{ROOT} is not a git checkout; clone the fork repository instead")
    return [p for p in proc.stdout.decode().split("\0") if p]


def fork_tree():
    """The fork's own tracked files; symlinks are stored as links (mode 0o120000)."""
    files = {}
    for rel in fork_tracked_files():
        path = ROOT / rel
        if path.is_symlink():
            files[rel] = (os.readlink(path).encode(), 0o120000)
        elif path.is_file():
            files[rel] = (path.read_bytes(), 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
    return files


# ----------------------------------------------------------------------------------------------
# Patch files


class PatchFile:
    """A git format-patch file: author, date, subject, body and the files it changes."""

    def __init__(self, author, date, subject, body, files):
        self.author, self.date, self.subject, self.body, self.files = author, date, subject, body, files

    @property
    def owned(self):
        return {path for path, _ in self.files}

    def _paragraphs(self):
        """(description, trailer lines): trailers are the last paragraph when every line is 'Key: value'."""
        paragraphs = [p for p in re.split(r"\n\s*\n", self.body.strip()) if p.strip()]
        if paragraphs and all(re.match(r"^[A-Za-z-]+:\s*\S", line) for line in paragraphs[-1].splitlines()):
            return "\n\n".join(paragraphs[:-1]), paragraphs[-1].splitlines()
        return "\n\n".join(paragraphs), []

    def trailers(self):
        return dict(line.split(":", 1)[0:1] + [line.split(":", 1)[1].strip()] for line in self._paragraphs()[1])

    def description(self):
        return self._paragraphs()[0].strip()


def parse_patch(text):
    lines = text.splitlines()
    headers, i = {}, 0
    last = None
    while i < len(lines) and lines[i] != "":
        line = lines[i]
        if line.startswith((" ", "\t")) and last:
            headers[last] += " " + line.strip()
        elif ":" in line and not line.startswith("From 0"):
            last, _, value = line.partition(":")
            headers[last] = value.strip()
        i += 1
    body_lines = []
    i += 1
    while i < len(lines) and lines[i] != "---" and not lines[i].startswith("diff --git "):
        body_lines.append(lines[i])
        i += 1
    files = []
    for line in lines[i:]:
        match = re.match(r"^diff --git a/(\S+) b/(\S+)$", line)
        if match:
            files.append((match.group(2), match.group(1)))
    author = headers.get("From", "")
    match = re.match(r"^(.*?)\s*<(.*)>$", author)
    return PatchFile((match.group(1), match.group(2)) if match else FIXED_AUTHOR, headers.get("Date", FIXED_DATE),
                     headers.get("Subject", ""), "\n".join(body_lines).strip("\n"), files)


def run_git(args, cwd, env=None, stdin=None):
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, env=env, input=stdin)
    if proc.returncode != 0:
        raise PatchSetError(f"git {' '.join(args[:2])} failed: {proc.stderr.decode().strip()[:300]}")
    return proc.stdout


def isolated_git_env(home, author=FIXED_AUTHOR, date=FIXED_DATE):
    """No user or system git config may change the bytes of an exported patch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(HOME=str(home), GIT_CONFIG_NOSYSTEM="1", GIT_AUTHOR_NAME=author[0], GIT_AUTHOR_EMAIL=author[1],
               GIT_COMMITTER_NAME=author[0], GIT_COMMITTER_EMAIL=author[1], GIT_AUTHOR_DATE=date,
               GIT_COMMITTER_DATE=date, LC_ALL="C", TZ="UTC")
    return env


def format_patch(before, after, message, author=FIXED_AUTHOR, date=FIXED_DATE, binary=False, opaque=()):
    """Render the change before -> after ({path: (bytes, mode)}) as `git format-patch` text.

    Files matching a glob in ``opaque`` are written as git binary patches (needs ``binary``).
    """
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "w"
        work.mkdir()
        env = isolated_git_env(tmp, author, date)
        run_git(["init", "-q"], work, env)
        run_git(["config", "core.autocrlf", "false"], work, env)
        (work / ".git" / "info").mkdir(exist_ok=True)
        (work / ".git" / "info" / "attributes").write_text("".join(f"{glob} binary\n" for glob in opaque))
        materialise(before, work)
        run_git(["add", "-A"], work, env)
        run_git(["commit", "-q", "--allow-empty", "-m", "base"], work, env)
        for rel in before:
            if rel not in after:
                (work / rel).unlink()
        materialise(after, work)
        run_git(["add", "-A"], work, env)
        run_git(["commit", "-q", "--allow-empty", "-F", "-"], work, env, stdin=message.encode())
        args = ["format-patch", *FORMAT_PATCH_ARGS, "-1", "HEAD"]
        if binary:
            args.insert(1, "--binary")
        return run_git(args, work, env).decode()


def materialise(files, dest):
    for rel, (data, mode) in files.items():
        path = Path(dest) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.exists():
            path.unlink()
        if mode == 0o120000:
            os.symlink(data.decode(), path)
        else:
            path.write_bytes(data)
            path.chmod(mode)


def render_patch(meta, pristine, current, paths, stages=None, name=None):
    """``meta``'s patch for ``paths``: pristine -> current, except where a file is stacked (see
    ``ownership``): there the diff runs between the file's states around this patch."""
    before = {p: pristine[p] for p in paths if p in pristine}
    after = {p: current[p] for p in paths if p in current}
    for path in paths:
        if stages and path in stages:
            before[path], frozen_after = stages[path][name]
            if frozen_after is not None:  # an earlier patch of a stacked file: kept as written
                after[path] = frozen_after
    message = meta.subject + ("\n\n" + meta.body if meta.body else "") + "\n"
    return format_patch(before, after, message, meta.author, meta.date)


def stacked_stages(pristine, metas, stacked):
    """For each stacked file: {patch: (state before it, state after it or None for the owner)},
    from applying the series' current patch files in order."""
    if not stacked:
        return {}
    stages = {path: {} for path in stacked}
    names = list(metas)
    last = max(names.index(owners[-1]) for owners in stacked.values())
    with tempfile.TemporaryDirectory() as tmp:
        write_tree(pristine, tmp)
        for name in names[:last + 1]:
            touched = [path for path in stacked if path in metas[name].owned]
            before = read_tree(tmp, touched)
            git_apply(PATCH_DIR / name, tmp, f"patches/{name}")
            after = read_tree(tmp, touched)
            for path in touched:
                owner = stacked[path][-1] == name
                stages[path][name] = (before[path], None if owner else after[path])
    return stages


# ----------------------------------------------------------------------------------------------
# Assembly


def state_dir():
    path = Path(run_git(["rev-parse", "--git-dir"], ROOT).decode().strip())
    path = path if path.is_absolute() else ROOT / path
    return path


def upstream_paths(expected, fork):
    return sorted(p for p in expected if p not in fork)


def cmd_tree(_args):
    pin = read_pin()
    require_tool("git", "apply the patches")
    fork = set(fork_tracked_files())
    expected = expected_tree(pin)
    paths = upstream_paths(expected, fork)
    manifest_path = state_dir() / GIT_DIR_STATE / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}

    to_write, kept = {}, []
    for rel in paths:
        data, mode = expected[rel]
        path = ROOT / rel
        if path.is_symlink() or not path.exists():
            to_write[rel] = (data, mode)
            continue
        current = path.read_bytes()
        if current == data:
            if (os.stat(path).st_mode & 0o111 != 0) != bool(mode & 0o111):
                to_write[rel] = (data, mode)
        elif manifest.get(rel) == hashlib.sha256(current).hexdigest():
            to_write[rel] = (data, mode)  # unchanged since the last assembly: follow the series
        else:
            kept.append(rel)
    stale = [p for p in manifest if p not in expected and p not in fork and (ROOT / p).is_file()
             and hashlib.sha256((ROOT / p).read_bytes()).hexdigest() == manifest[p]]

    write_tree(to_write, ROOT)
    for rel in stale:
        (ROOT / rel).unlink()
    new_manifest = {p: hashlib.sha256(expected[p][0]).hexdigest() for p in paths if p not in kept}
    for rel in kept:
        new_manifest[rel] = manifest.get(rel, "")
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(new_manifest, indent=0, sort_keys=True))
    write_exclude(paths)
    print(f"patchset: upstream {pin['name']} {pin['version']} assembled in {ROOT} "
          f"({len(paths)} upstream files, {len(to_write)} written, {len(read_series())} patches, "
          f"version {fork_version(pin)})")
    if kept:
        print(f"patchset: kept {len(kept)} locally edited upstream file(s) (run 'make export' to save them): "
              + ", ".join(kept[:8]) + (" ..." if len(kept) > 8 else ""))


def write_exclude(paths):
    exclude = state_dir() / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    text = exclude.read_text() if exclude.is_file() else ""
    text = re.sub(re.escape(EXCLUDE_BEGIN) + r".*?" + re.escape(EXCLUDE_END) + r"\n?", "", text, flags=re.S)
    block = "\n".join([EXCLUDE_BEGIN] + ["/" + glob_escape(p) for p in paths] + [EXCLUDE_END])
    exclude.write_text(text.rstrip("\n") + ("\n" if text.strip() else "") + block + "\n")


def glob_escape(path):
    return re.sub(r"([\[\]*?!#\\ ])", r"\\\1", path)


# ----------------------------------------------------------------------------------------------
# Export


def load_series_meta():
    metas = {}
    for name in read_series():
        path = PATCH_DIR / name
        if not path.is_file():
            raise PatchSetError(f"patches/series lists {name} but patches/{name} does not exist")
        metas[name] = parse_patch(path.read_text())
    return metas


def ownership(metas):
    """(owner, stacked): the patch whose diff a file's edits go to, and the files several patches
    change, each with its patches in series order.

    An upstream file belongs to one patch, with one exception: a patch that must stay separate
    (an upstream bug fix, say) may change a file a later patch also changes when it names the file
    in its ``Stacked-files:`` trailer. Its hunks are then kept as written; the last patch that
    changes the file owns it, and its diff starts where the earlier ones leave the file."""
    owner, stacked = {}, {}
    for name, meta in metas.items():
        for path in meta.owned:
            if path in owner:
                declared = [p.strip() for p in metas[owner[path]].trailers().get(STACK_TRAILER, "").split(",")]
                if path not in declared:
                    raise PatchSetError(f"{path} is changed by both {owner[path]} and {name}; an upstream file "
                                        f"belongs to one patch only (merge the two changes, or keep the earlier "
                                        f"one as written by naming the file in its '{STACK_TRAILER}:' trailer)")
                stacked.setdefault(path, [owner[path]])
                stacked[path].append(name)
            owner[path] = name
    return owner, stacked


def current_upstream(paths):
    missing = [p for p in paths if not (ROOT / p).is_file()]
    if missing and len(missing) == len(paths):
        raise PatchSetError("the upstream tree is not assembled here; run 'make tree' first")
    if missing:
        raise PatchSetError(f"upstream file(s) deleted from the tree: {', '.join(missing[:5])}; deleting "
                            f"upstream files is not supported by export, restore them with 'make tree'")
    return read_tree(ROOT, paths)


def mirror_twin(rel):
    for left, right in MIRRORS:
        if rel.startswith(left):
            return right + rel[len(left):]
        if rel.startswith(right):
            return left + rel[len(right):]
    return None


def sync_mirrors(baseline, current):
    """Copy an edit of one sdist copy (op_builder/, accelerator/, csrc/) to its twin.

    ``baseline`` is the tree as last assembled (pristine + series): the copy that moved away
    from it is the one the developer edited."""
    changed = []
    for left, right in MIRRORS:
        for rel in list(current):
            if not rel.startswith(left):
                continue
            twin = right + rel[len(left):]
            if twin not in current:
                continue
            a_edit, b_edit = current[rel] != baseline.get(rel), current[twin] != baseline.get(twin)
            if a_edit and b_edit and current[rel] != current[twin]:
                raise PatchSetError(f"{rel} and {twin} are copies in the sdist but were edited differently; "
                                    f"make them identical")
            if a_edit != b_edit:
                src, dst = (rel, twin) if a_edit else (twin, rel)
                current[dst] = current[src]
                (ROOT / dst).write_bytes(current[src][0])
                changed.append(dst)
    return changed


def export(assign=None, new_meta=None, write=True, allow_orphans=False):
    """Regenerate every patch from the tree. Returns {name: text} of patches that would change."""
    pin = read_pin()
    pristine = pristine_tree(pin)
    metas = load_series_meta()
    if new_meta is not None:
        metas[new_meta[0]] = new_meta[1]
    owner, stacked = ownership(metas)
    for path, name in (assign or {}).items():
        if path not in pristine:
            raise PatchSetError(f"{path} is not an upstream file (a file of the fork's own is committed as is)")
        if owner.get(path, name) != name:
            raise PatchSetError(f"{path} already belongs to {owner[path]}")
        owner[path] = name
    fork = set(fork_tracked_files())
    paths = upstream_paths(pristine, fork)
    current = current_upstream(paths)
    mirrored = sync_mirrors(expected_tree(pin, pristine), current) if write else []
    edited = [p for p in paths if current[p] != pristine[p]]
    for rel in edited:  # an sdist copy belongs to the patch that owns its twin
        if rel not in owner and mirror_twin(rel) in owner:
            owner[rel] = owner[mirror_twin(rel)]
    orphans = [p for p in edited if p not in owner]
    if orphans and allow_orphans:
        print(f"patchset: warning: still without a patch: {', '.join(orphans)}")
    elif orphans:
        raise PatchSetError(
            f"edited upstream file(s) without a patch: {', '.join(orphans)}; add them to a patch with "
            f"'python scripts/patchset.py new NAME --why TEXT FILE...' or '... assign PATCH FILE...'")
    stages = stacked_stages(pristine, metas, stacked)
    texts = {}
    for name, meta in metas.items():
        files = sorted({p for p in edited if owner.get(p) == name} | {p for p in stacked if name in stacked[p]})
        if not files:
            raise PatchSetError(f"patches/{name} has no edits left in the tree; remove it from patches/series "
                                f"and delete the file, or restore its edits")
        text = render_patch(meta, pristine, current, files, stages, name)
        path = PATCH_DIR / name
        if not path.is_file() or path.read_text() != text:
            texts[name] = text
    if write:
        for name, text in texts.items():
            (PATCH_DIR / name).write_text(text)
        if new_meta is not None and new_meta[0] not in read_series():
            with open(SERIES, "a") as handle:
                handle.write(new_meta[0] + "\n")
        expected = {p: current[p] for p in paths}
        manifest_path = state_dir() / GIT_DIR_STATE / "manifest.json"
        manifest_path.parent.mkdir(parents=True, exist_ok=True)
        manifest_path.write_text(json.dumps({p: hashlib.sha256(d).hexdigest() for p, (d, _) in expected.items()},
                                            indent=0, sort_keys=True))
    return texts, mirrored


def cmd_export(args):
    texts, mirrored = export(assign={f: args.patch for f in args.files} if getattr(args, "patch", None) else None)
    for rel in mirrored:
        print(f"patchset: mirrored edit into {rel}")
    print(f"patchset: {len(texts)} patch(es) rewritten" + (": " + ", ".join(sorted(texts)) if texts else ""))


def cmd_new(args):
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*\.patch", args.name):
        raise PatchSetError(f"patch name {args.name!r}: use lowercase words joined by '-' ending in .patch, "
                            f"no numbers in front (e.g. engine-heterogeneous-hooks.patch)")
    if args.name in read_series() or (PATCH_DIR / args.name).exists():
        raise PatchSetError(f"patches/{args.name} exists already; use 'assign' to give it more files")
    if not args.why.strip():
        raise PatchSetError("--why must say why the change exists and how it could go away")
    subject, _, rest = args.why.strip().partition("\n")
    body = (rest.strip() + "\n\n" if rest.strip() else "") + f"Origin: {args.origin}\nForwarded: {args.forwarded}"
    meta = PatchFile(FIXED_AUTHOR, FIXED_DATE, subject.strip(), body, [])
    PATCH_DIR.mkdir(exist_ok=True)
    export(assign={f: args.name for f in args.files}, new_meta=(args.name, meta), allow_orphans=True)
    print(f"patchset: created patches/{args.name}; edit its message, then 'make export'")


# ----------------------------------------------------------------------------------------------
# Packaging


def assembled_tree(pin, expected=None):
    """What the assembled tree should hold: upstream (pristine + series) overlaid by the fork."""
    expected = expected_tree(pin) if expected is None else expected
    files = dict(expected)
    files.update(fork_tree())
    return files


def dereference(files):
    """Resolve the fork's in-tree symlinks into file copies (archives must install anywhere)."""
    out = {}
    for rel, (data, mode) in files.items():
        if mode == 0o120000:
            target = os.path.normpath(os.path.join(os.path.dirname(rel), data.decode()))
            if target in files:
                out[rel] = files[target]
            else:  # a link to a directory: copy every file below it
                for sub, value in files.items():
                    if sub.startswith(target + "/"):
                        out[rel + sub[len(target):]] = value
        else:
            out[rel] = (data, mode)
    return {k: v for k, v in out.items() if v[1] != 0o120000}


def source_archive(pin, tree):
    top = f"{pin['name']}-{fork_version(pin)}"
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(tree):
            data, mode = tree[rel]
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), mode, 0, 0, 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
    import gzip
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0) as gz:
        gz.write(buffer.getvalue())
    return f"{top}.tar.gz", out.getvalue()


def combined_patch(pin, pristine, tree):
    message = (f"deepspeed-hetero {fork_version(pin)}: the whole fork on upstream {pin['version']}\n\n"
               f"Apply with 'git apply' to a pristine DeepSpeed {pin['version']} (the PyPI sdist, or a\n"
               f"checkout of v{pin['version']}): it adds the fork's modules and applies patches/series.\n")
    name = f"deepspeed-hetero-{fork_version(pin)}.patch"
    # The series' own files are diffs: blank context lines are a lone space, which git apply
    # would report as whitespace errors in the lines the combined patch adds. As binary hunks
    # they apply byte for byte and without warnings.
    return name, format_patch(pristine, tree, message, binary=True, opaque=("patches/*.patch", ))


def cmd_dist(args):
    pin = read_pin()
    pristine = pristine_tree(pin)
    tree = assembled_tree(pin, expected_tree(pin, pristine))
    out = ROOT / "dist"
    out.mkdir(exist_ok=True)
    archive_name, archive = source_archive(pin, dereference(tree))
    (out / archive_name).write_bytes(archive)
    patch_name, patch = combined_patch(pin, pristine, tree)
    (out / patch_name).write_text(patch)
    comm_path, comm_lines = comm_patch_module().write(this_module(), pin, pristine)
    print(f"patchset: wrote dist/{archive_name} ({len(archive) // 1024} KiB), dist/{patch_name} "
          f"({len(patch.splitlines())} lines) and patches/{comm_path.name} ({comm_lines} lines)")


# ----------------------------------------------------------------------------------------------
# Check


def changed_lines(text):
    """Added plus removed lines of a patch's diffs (file headers not counted)."""
    count, in_diff = 0, False
    for line in text.splitlines():
        if line.startswith("diff --git "):
            in_diff = True
        elif in_diff and line.startswith(("+++ ", "--- ")):
            continue
        elif in_diff and line[:1] in "+-" and line:
            count += 1
    return count


def check_patch_sizes(names):
    """Problems with patches that are not thin, and the sizes for the report."""
    sizes = {name: changed_lines((PATCH_DIR / name).read_text()) for name in names if (PATCH_DIR / name).is_file()}
    problems = [f"patches/{name} changes {size} lines (at most {MAX_CHANGED_LINES}): move logic into the fork's "
                f"modules or split it by concern" for name, size in sizes.items() if size > MAX_CHANGED_LINES]
    ordered = sorted(sizes.values())
    median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2 if ordered else 0
    if median > MAX_MEDIAN_CHANGED_LINES:
        problems.append(f"the median patch changes {median:g} lines (at most {MAX_MEDIAN_CHANGED_LINES})")
    return problems, sizes, median


def check_series_folder():
    problems = []
    names = read_series()
    seen = set()
    for name in names:
        if name in seen:
            problems.append(f"patches/series lists {name} twice")
        seen.add(name)
        if not (PATCH_DIR / name).is_file():
            problems.append(f"patches/series lists {name}, which does not exist")
    for path in sorted(PATCH_DIR.glob("*.patch")) if PATCH_DIR.is_dir() else []:
        if path.name not in seen and not comm_patch_module().is_generated(path):  # an output of make dist
            problems.append(f"patches/{path.name} is not listed in patches/series")
    for name in names:
        path = PATCH_DIR / name
        if not path.is_file():
            continue
        meta = parse_patch(path.read_text())
        if not meta.subject or not meta.description():
            problems.append(f"patches/{name} lacks a description (a subject and a paragraph saying why)")
        missing = [t for t in REQUIRED_TRAILERS if t not in meta.trailers()]
        if missing:
            problems.append(f"patches/{name} lacks the trailer(s) {', '.join(missing)}")
        if not meta.files:
            problems.append(f"patches/{name} changes no file")
    problems += check_patch_sizes(names)[0]
    return problems


def apply_to_pristine(pristine, patch_text):
    """Apply a git-apply patch to pristine upstream in a temporary git repository; return the tree."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "w"
        work.mkdir()
        env = isolated_git_env(tmp)
        run_git(["init", "-q"], work, env)
        write_tree(pristine, work)
        run_git(["add", "-A"], work, env)
        run_git(["commit", "-q", "-m", "pristine"], work, env)
        (Path(tmp) / "p.patch").write_text(patch_text)
        proc = subprocess.run(["git", "apply", "--whitespace=nowarn", str(Path(tmp) / "p.patch")], cwd=work,
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise PatchSetError(f"the combined patch does not apply to pristine upstream: {proc.stderr.strip()}")
        run_git(["add", "-A"], work, env)
        listed = run_git(["ls-files", "-z"], work, env).decode().split("\0")
        tree = {}
        for rel in filter(None, listed):
            path = work / rel
            if path.is_symlink():
                tree[rel] = (os.readlink(path).encode(), 0o120000)
            else:
                tree[rel] = (path.read_bytes(), 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
        return tree


def diff_trees(want, got, label):
    problems = []
    for rel in sorted(set(want) | set(got)):
        if rel not in got:
            problems.append(f"{label}: {rel} is missing")
        elif rel not in want:
            problems.append(f"{label}: {rel} is extra")
        elif want[rel] != got[rel]:
            problems.append(f"{label}: {rel} differs")
    return problems


def cmd_check(_args):
    pin = read_pin()
    problems = check_series_folder()
    pristine = pristine_tree(pin)
    try:
        metas = load_series_meta()
        _, stacked = ownership(metas)
        expected = expected_tree(pin, pristine)
        stages = stacked_stages(pristine, metas, stacked)
    except PatchSetError as exc:
        problems.append(str(exc))
        expected = None
    if expected is not None:
        fork = set(fork_tracked_files())
        paths = upstream_paths(expected, fork)
        overlap = sorted(p for m in metas.values() for p in m.owned if p in fork)
        copied = sorted(p for p in fork if p in pristine and (ROOT / p).is_file()
                        and (ROOT / p).read_bytes() == pristine[p][0])
        if copied:
            problems.append("upstream file(s) are committed unchanged (they arrive from the sdist; 'git rm --cached' "
                            "them): " + ", ".join(copied[:10]) + (f" and {len(copied) - 10} more" if len(copied) > 10
                                                                  else ""))
        if overlap:
            problems.append(f"patches change files the fork tracks itself: {', '.join(overlap)}")
        present = [p for p in paths if (ROOT / p).is_file()]
        if not present:
            problems.append("the upstream tree is not assembled; run 'make tree'")
        else:
            current = read_tree(ROOT, paths)
            drift = [p for p in paths if current.get(p) != expected[p]]
            if drift:
                problems.append("upstream file(s) differ from pristine + patches/series (unexported edits; run "
                                "'make export', or 'make tree' after a pull): " + ", ".join(drift[:10]) +
                                (f" and {len(drift) - 10} more" if len(drift) > 10 else ""))
            for left, right in MIRRORS:
                for rel in paths:
                    twin = right + rel[len(left):] if rel.startswith(left) else None
                    if twin in expected and expected[rel] != expected[twin]:
                        problems.append(f"{rel} and its sdist copy {twin} differ in the series")
            if not drift and not problems:
                for name, meta in metas.items():
                    if render_patch(meta, pristine, expected, sorted(meta.owned), stages,
                                    name) != (PATCH_DIR / name).read_text():
                        problems.append(f"patches/{name} is not in canonical export form; run 'make export'")
                tree = assembled_tree(pin, expected)
                _, patch = combined_patch(pin, pristine, tree)
                problems += diff_trees(tree, apply_to_pristine(pristine, patch), "combined patch")
                archive_name, archive = source_archive(pin, dereference(tree))
                problems += diff_trees(dereference(tree), read_archive(archive), "source archive")
                problems += comm_patch_module().problems(this_module(), pin, pristine)
    if problems:
        for problem in problems:
            print(f"check: FAIL {problem}", file=sys.stderr)
        raise PatchSetError(f"{len(problems)} problem(s) found")
    _, sizes, median = check_patch_sizes(list(metas))
    print(f"check: OK ({len(metas)} patches apply to pristine {pin['name']} {pin['version']}, tree matches the "
          f"series, exports are canonical, the combined patch, the source archive and the communication patch "
          f"reproduce their trees; changed "
          f"lines per patch: median {median:g}, largest {max(sizes.values(), default=0)})")


def read_archive(archive):
    tree = {}
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.isfile():
                rel = member.name.split("/", 1)[1]
                tree[rel] = (tar.extractfile(member).read(), 0o755 if member.mode & 0o111 else 0o644)
    return tree


def main(argv=None):
    parser = argparse.ArgumentParser(prog="patchset", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("tree", help="assemble upstream + patches in the repository root")
    sub.add_parser("export", help="regenerate patches/*.patch from edited upstream files")
    assign = sub.add_parser("assign", help="give edited upstream files to an existing patch, then export")
    assign.add_argument("patch")
    assign.add_argument("files", nargs="+")
    new = sub.add_parser("new", help="create a patch owning some edited upstream files")
    new.add_argument("name", help="e.g. engine-heterogeneous-hooks.patch")
    new.add_argument("files", nargs="+")
    new.add_argument("--why", required=True, help="subject line, then a paragraph: why, and how it could go away")
    new.add_argument("--origin", default="vendor", choices=["vendor", "backport", "upstream"])
    new.add_argument("--forwarded", default="not-needed")
    sub.add_parser("check", help="verify the series, the tree, the exports and the packages")
    sub.add_parser("dist", help="write the source archive and the combined patch into dist/")
    sub.add_parser("version", help="print the fork's version")
    args = parser.parse_args(argv)
    try:
        if args.command == "tree":
            cmd_tree(args)
        elif args.command in ("export", "assign"):
            if args.command == "assign" and args.patch not in read_series():
                raise PatchSetError(f"{args.patch} is not in patches/series; use 'new' to start a patch")
            cmd_export(args)
        elif args.command == "new":
            cmd_new(args)
        elif args.command == "check":
            cmd_check(args)
        elif args.command == "dist":
            cmd_dist(args)
        elif args.command == "version":
            print(fork_version(read_pin()))
    except PatchSetError as exc:
        print(f"patchset: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
