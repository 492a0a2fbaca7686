#!/usr/bin/env python3
"""Write the GPU bundle: what the GPU machine's image lacks to run scripts/device_check.sh.

    python3 scripts/device_bundle.py [--out device-bundle]          (make device-bundle)

The GPU machine has no network, its own python3 (3.12, x86-64) with torch 2.11, and receives only
the working tree plus a few ignored paths, 64 MiB in all. The assembled upstream tree is ignored
by git and does not travel. The bundle is one folder holding:

- the fork as a wheel, ``deepspeed-<version>-py3-none-any.whl``: upstream + patches/series + the
  fork's tracked files (the archive ``make dist`` writes, built with ``DS_BUILD_OPS=0``: no op is
  prebuilt, each JIT-builds with ninja on first use, the CUDA ones with the machine's nvcc);
- wheels of every requirement of the fork, and of theirs, that the image's package list
  (``scripts/device_image_packages.txt``) does not hold; torch is never bundled. Binary wheels are
  there for the GPU machine's Python (cp312, manylinux x86-64) and for each ``--also-python``
  (default: this interpreter's, for the rehearsal), so that
  ``pip install --no-index --find-links BUNDLE NAMES`` picks the matching one on either machine;
- ``manifest.json``: each file, its size, sha256 and why it is there; the fork files the wheel was
  built from (with a digest, so that the check can say whether the tree beside it still matches).

Fails (exit 2) when the bundle and the working tree that travels with it reach the 64 MiB limit.
Needs python3 with pip and network access to the package index (the wheel build fetches setuptools;
the dependencies are downloaded); nothing afterwards.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import patchset  # noqa: E402

try:  # the real library where installed, else pip's own copy (pip is required anyway)
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover - depends on the interpreter
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

LIMIT_BYTES = 64 * 2**20  # what may travel to the GPU machine: working tree + carried paths
TARGET_PYTHON = "3.12"  # the GPU image's python3 (3.12.3)
TARGET_PYTHON_FULL = "3.12.3"
NEVER_BUNDLED = {"torch"}  # the image's own CUDA build is the one to test
# pip matches --platform tags exactly: every glibc manylinux tag up to the image's (Ubuntu 24.04: 2.39).
MANYLINUX_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# Fork files whose content the wheel holds; device_check.sh compares the tree it runs in with these.
FORK_SOURCE_PREFIXES = ("deepspeed/", "op_builder/", "csrc/", "accelerator/", "patches/", "UPSTREAM", "setup.py",
                        "requirements/")


class BundleError(Exception):
    """A failure the user can act on: printed as one line, exit status 2."""


def log(message):
    print(f"device-bundle: {message}", flush=True)


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def sha256_file(path):
    return sha256_bytes(Path(path).read_bytes())


def read_image_packages(path):
    """{canonical name: version or None} from the image's package list."""
    packages = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise BundleError(f"{path}:{number}: expected NAME or NAME==VERSION, got {line!r}")
        packages[canonicalize_name(name.strip())] = version.strip() or None
    return packages


def marker_environments(also_pythons):
    """Marker environments to resolve for: the GPU image, then each rehearsal interpreter."""
    target = dict(default_environment())
    target.update(python_version=TARGET_PYTHON, python_full_version=TARGET_PYTHON_FULL, sys_platform="linux",
                  platform_system="Linux", platform_machine="x86_64", os_name="posix", implementation_name="cpython",
                  platform_python_implementation="CPython", implementation_version=TARGET_PYTHON_FULL)
    environments = {TARGET_PYTHON: target}
    for version in also_pythons:
        env = dict(target)
        env.update(python_version=version, python_full_version=f"{version}.0", implementation_version=f"{version}.0")
        if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
            env = dict(default_environment())
        environments[version] = env
    return environments


def wheel_metadata(path):
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = archive.read(name).decode()
    fields = {"Requires-Dist": []}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Requires-Dist":
            fields[key].append(value)
        elif key in ("Name", "Version") and key not in fields:
            fields[key] = value
    return fields


def wheel_is_pure(path):
    tags = Path(path).name[:-len(".whl")].split("-")[-3:]
    return tags[1] == "none" and tags[2] == "any"


def run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise BundleError(f"{' '.join(map(str, cmd))} failed (exit {proc.returncode}):\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc


def pip_download(requirement, dest, python_version=None):
    """Download one wheel (no dependencies) of ``requirement``; for ``python_version`` (cp, x86-64
    manylinux) or, without it, for this interpreter. Returns the wheel's path."""
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest)]
    if python_version:
        cmd += ["--python-version", python_version, "--implementation", "cp"]
        for platform in MANYLINUX_PLATFORMS:
            cmd += ["--platform", platform]
    run(cmd + [str(requirement)])
    new = sorted(set(os.listdir(dest)) - before)
    wheels = [f for f in new if f.endswith(".whl")]
    if not wheels:  # already there from an earlier requirement: find it by name
        name = canonicalize_name(Requirement(str(requirement)).name).replace("-", "_")
        wheels = [f for f in os.listdir(dest) if f.lower().startswith(name + "-") and f.endswith(".whl")]
    if len(wheels) != 1:
        raise BundleError(f"pip download {requirement} ({python_version or 'this interpreter'}) gave {wheels}")
    return Path(dest) / wheels[0]


def satisfied_by_image(requirement, image):
    """None when the image lacks the package, else why it is taken as satisfied."""
    name = canonicalize_name(requirement.name)
    if name not in image:
        return None
    version = image[name]
    if version is None:
        return "in the image (version not listed: assumed to satisfy)"
    if requirement.specifier and not requirement.specifier.contains(Version(version), prereleases=True):
        return False
    return f"in the image ({version})"


def resolve_dependencies(fork_wheel, image, environments, download_dir):
    """Walk the fork's requirements; return (bundled, decisions). ``bundled`` maps a canonical name
    to {wheel paths, version, why}; ``decisions`` lists each requirement met and what met it."""
    bundled, decisions = {}, []
    queue = [("deepspeed", r) for r in wheel_metadata(fork_wheel)["Requires-Dist"]]
    seen = set()
    while queue:
        parent, text = queue.pop(0)
        requirement = Requirement(text)
        wanted_for = [v for v, env in environments.items()
                      if requirement.marker is None or requirement.marker.evaluate(dict(env, extra=""))]
        if not wanted_for:
            continue
        name = canonicalize_name(requirement.name)
        key = (parent, name, str(requirement.specifier))
        if key in seen:
            continue
        seen.add(key)
        entry = {"requirement": text, "required_by": parent, "for_python": wanted_for}
        if name in NEVER_BUNDLED:
            decisions.append(dict(entry, met_by="never bundled: the image's own CUDA build"))
            continue
        image_says = satisfied_by_image(requirement, image)
        if image_says is False:
            raise BundleError(f"{parent} requires {text}, but the image has {requirement.name}=={image[name]}: "
                              "a bundled second version would shadow the image's; resolve this by hand")
        if image_says:
            decisions.append(dict(entry, met_by=image_says))
            continue
        if name in bundled:
            if not requirement.specifier.contains(Version(bundled[name]["version"]), prereleases=True):
                raise BundleError(f"{parent} requires {text}, but the bundle already holds "
                                  f"{name}=={bundled[name]['version']}")
            bundled[name]["why"].append(f"{parent} requires {text}")
            decisions.append(dict(entry, met_by=f"bundled ({bundled[name]['version']})"))
            continue
        wheel = pip_download(text if not requirement.marker else f"{requirement.name}{requirement.specifier}",
                             download_dir, TARGET_PYTHON)
        meta = wheel_metadata(wheel)
        version = meta["Version"]
        wheels = [wheel]
        if not wheel_is_pure(wheel):
            for python in environments:
                if python != TARGET_PYTHON:
                    wheels.append(pip_download(f"{requirement.name}=={version}", download_dir,
                                               None if python == f"{sys.version_info[0]}.{sys.version_info[1]}" else python))
        bundled[name] = {"name": meta["Name"], "version": version, "wheels": wheels,
                         "why": [f"{parent} requires {text}; not in the image"]}
        decisions.append(dict(entry, met_by=f"bundled ({version})"))
        log(f"bundling {meta['Name']} {version} ({', '.join(w.name for w in wheels)}): {parent} requires {text}")
        queue.extend((meta["Name"], r) for r in meta["Requires-Dist"])
    return bundled, decisions


def travelling_tree():
    """(paths, bytes) of what reaches the GPU machine besides carried paths: tracked files and
    untracked files git does not ignore."""
    proc = run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT)
    paths = sorted({p for p in proc.stdout.split("\0") if p})
    size = sum((ROOT / p).lstat().st_size for p in paths if (ROOT / p).exists() or (ROOT / p).is_symlink())
    return paths, size


def fork_sources():
    """{path: sha256} of the fork's tracked files that the wheel holds (links read through), and
    untracked files in those folders that the wheel does not hold (named in a warning)."""
    tracked = patchset.fork_tracked_files()
    digests = {}
    for rel in tracked:
        if rel.startswith(FORK_SOURCE_PREFIXES) and (ROOT / rel).is_file():
            digests[rel] = sha256_file(ROOT / rel)
    untracked = run(["git", "ls-files", "-z", "-o", "--exclude-standard"], cwd=ROOT).stdout.split("\0")
    missing = sorted(p for p in untracked if p and p.startswith(FORK_SOURCE_PREFIXES))
    return digests, missing


def tree_digest(digests):
    return sha256_bytes("".join(f"{path}\0{digest}\n" for path, digest in sorted(digests.items())).encode())


def build_fork_wheel(workdir):
    """Assemble the source archive (as make dist does) and build the fork's wheel from it."""
    pin = patchset.read_pin()
    pristine = patchset.pristine_tree(pin)
    tree = patchset.assembled_tree(pin, patchset.expected_tree(pin, pristine))
    archive_name, archive = patchset.source_archive(pin, patchset.dereference(tree))
    (workdir / archive_name).write_bytes(archive)
    src = workdir / "src"
    with tarfile.open(workdir / archive_name) as tar:
        # Our own archive, just written; the 'data' filter where this Python has it.
        tar.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (top, ) = list(src.iterdir())
    wheel_dir = workdir / "wheel"
    env = dict(os.environ, DS_BUILD_OPS="0")
    env.pop("DS_BUILD_HETEROGENEOUS", None)
    log(f"building the fork's wheel from {archive_name} (DS_BUILD_OPS=0: ops JIT-build on the GPU machine)")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q", "-w", str(wheel_dir),
         str(top)], env=env, cwd=workdir)
    (wheel, ) = list(wheel_dir.glob("*.whl"))
    if not wheel_is_pure(wheel):
        raise BundleError(f"the fork's wheel {wheel.name} is not pure Python: an op was prebuilt")
    return pin, wheel, archive_name, sha256_bytes(archive)


def git_head():
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout.strip() or None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="device-bundle", help="the bundle folder (replaced; default %(default)s)")
    parser.add_argument("--image-packages", default=str(ROOT / "scripts" / "device_image_packages.txt"))
    parser.add_argument("--also-python", action="append", metavar="X.Y",
                        help="also bundle binary wheels for this CPython (repeatable; default: this interpreter's, "
                        "for the rehearsal)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out = out if out.is_absolute() else ROOT / out
    this_python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    also = args.also_python if args.also_python is not None else [this_python]
    also = [v for v in dict.fromkeys(also) if v != TARGET_PYTHON]
    began = time.monotonic()
    try:
        image = read_image_packages(args.image_packages)
        digests, untracked = fork_sources()
        if untracked:
            log("WARNING: untracked files the wheel will not hold (git add them first): " + ", ".join(untracked))
        with tempfile.TemporaryDirectory(prefix="device-bundle-") as tmp:
            tmp = Path(tmp)
            pin, fork_wheel, archive_name, archive_sha = build_fork_wheel(tmp)
            downloads = tmp / "downloads"
            downloads.mkdir()
            bundled, decisions = resolve_dependencies(fork_wheel, image, marker_environments(also), downloads)
            staging = Path(tempfile.mkdtemp(prefix=".device-bundle-", dir=out.parent))
            files = []

            def add(path, name, version, why, python):
                shutil.copy2(path, staging / path.name)
                data = (staging / path.name).read_bytes()
                files.append({"file": path.name, "name": name, "version": version, "bytes": len(data),
                              "sha256": sha256_bytes(data), "python": python, "why": why})

            add(fork_wheel, "deepspeed", wheel_metadata(fork_wheel)["Version"],
                [f"the fork: upstream DeepSpeed {pin['version']} + patches/series + the fork's files, "
                 f"from {archive_name} (the make dist archive, sha256 {archive_sha[:16]}...), DS_BUILD_OPS=0"], "any")
            for entry in sorted(bundled.values(), key=lambda e: e["name"].lower()):
                for wheel in entry["wheels"]:
                    tag = wheel.name[:-4].split("-")[-3]
                    add(wheel, entry["name"], entry["version"], entry["why"], "any" if wheel_is_pure(wheel) else tag)
            tree_paths, tree_bytes = travelling_tree()
            bundle_bytes = sum(f["bytes"] for f in files)
            manifest = {
                "what": "wheels for scripts/device_check.sh --bundle on the GPU machine (no network there)",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "install": "python3 -m pip install --no-index --find-links BUNDLE " +
                           " ".join([f"deepspeed=={files[0]['version']}"] +
                                    [f"{e['name']}=={e['version']}" for e in bundled.values()]),
                "fork": {"name": "deepspeed", "version": files[0]["version"], "wheel": files[0]["file"],
                         "upstream": pin["version"], "git_head": git_head(), "source_archive": archive_name,
                         "source_archive_sha256": archive_sha, "tree_digest": tree_digest(digests),
                         "tree_files": dict(sorted(digests.items()))},
                "target": {"python": TARGET_PYTHON, "platforms": "manylinux x86_64 (glibc <= 2.39)",
                           "also_python": also},
                "image_packages": {"file": os.path.relpath(args.image_packages, ROOT),
                                   "sha256": sha256_file(args.image_packages)},
                "dependencies": [{"name": e["name"], "version": e["version"]} for e in bundled.values()],
                "requirements": decisions,
                "files": files,
                "bundle_bytes": bundle_bytes,
                "working_tree_bytes": tree_bytes,
                "working_tree_files": len(tree_paths),
                "limit_bytes": LIMIT_BYTES,
            }
            (staging / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
            total = bundle_bytes + (staging / "manifest.json").stat().st_size + tree_bytes
            if total >= LIMIT_BYTES:
                shutil.rmtree(staging)
                raise BundleError(f"bundle {bundle_bytes / 2**20:.1f} MiB + working tree {tree_bytes / 2**20:.1f} MiB "
                                  f"= {total / 2**20:.1f} MiB: at or over the {LIMIT_BYTES // 2**20} MiB that may "
                                  "travel to the GPU machine")
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
    except (BundleError, patchset.PatchSetError) as exc:
        print(f"device-bundle: error: {exc}", file=sys.stderr)
        return 2
    log(f"wrote {os.path.relpath(out, ROOT)}/: {len(files)} wheels, {bundle_bytes / 2**20:.2f} MiB "
        f"(+ working tree {tree_bytes / 2**20:.2f} MiB = {total / 2**20:.2f} MiB of the {LIMIT_BYTES // 2**20} MiB "
        f"limit) in {time.monotonic() - began:.0f} s")
    for f in files:
        log(f"  {f['file']}  {f['bytes'] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
