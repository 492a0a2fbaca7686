#!/usr/bin/env python3
"""Rehearse the GPU run here, without a GPU: make device-rehearsal.

    python3 scripts/device_rehearsal.py [--bundle device-bundle] [--venv .device-rehearsal-venv] [--out device-rehearsal]

1. A venv that mirrors the GPU image where the check needs it: torch 2.11.0 from the package index
   (PyPI's x86-64 torch is the CUDA build; it runs on the CPU) and the image's other packages the
   check uses, at the image's versions where scripts/device_image_packages.txt gives them (one that
   has no wheel for this Python is installed unpinned, and said so).
2. Everything the bundle provides is uninstalled from it, then installed back by the check itself
   from the bundle alone (pip --no-index).
3. The check runs in a copy of what travels to the GPU machine (tracked files and untracked files git
   does not ignore, plus the bundle), not in this assembled tree, with no network: in a network
   namespace of its own where this runs as root (loopback only), else with pip kept off the index.
   `scripts/device_check.sh --rehearsal --bundle device-bundle OUT`: every stage that can run on the
   CPU runs, the stages that need CUDA say "skipped: no GPU (rehearsal)".

OUT receives what the GPU run would return: summary.json, summary.txt, stages.log. Exit status: the
check's. Too heavy for CI (the torch download is several GB); not part of make test.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What the check imports from the image, besides the bundle: the fork's runtime requirements, the
# test runner, and the Hugging Face packages the image holds at known versions.
CHECK_NEEDS = ("torch", "numpy", "packaging", "psutil", "py-cpuinfo", "msgpack", "ninja", "einops", "tqdm",
               "nvidia-ml-py", "typing-extensions", "filelock", "pytest", "pytest-timeout", "transformers",
               "accelerate", "huggingface-hub", "safetensors", "tokenizers", "matplotlib")


def log(message):
    print(f"device-rehearsal: {message}", flush=True)


def image_versions(path):
    versions = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            versions[name.lower().replace("_", "-")] = version or None
    return versions


def pip(venv_python, *args, check=True):
    cmd = [str(venv_python), "-m", "pip", "--disable-pip-version-check", *args]
    log("$ " + " ".join(cmd[1:]))
    return subprocess.run(cmd, check=check).returncode


def make_venv(venv, image):
    python = venv / "bin" / "python"
    specs = []
    for name in CHECK_NEEDS:
        if name not in image:
            raise SystemExit(f"device-rehearsal: {name} is not in the image's package list")
        specs.append(f"{name}=={image[name]}" if image[name] else name)
    stamp = venv / ".device-image"
    if stamp.is_file() and stamp.read_text() == "\n".join(specs):
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # torch alone first, at the image's version: anything unpinned would pull another.
    torch = [s for s in specs if s.startswith("torch==")]
    pip(python, "install", "-q", *torch)
    constraint = venv / "torch-constraint.txt"
    constraint.write_text("\n".join(torch) + "\n")
    if pip(python, "install", "-q", "-c", str(constraint), *specs, check=False) != 0:
        # A version the image has may have no wheel for this Python (numpy 2.5 is 3.12+): unpin those.
        unpinned = []
        for spec in specs:
            if "==" in spec and not spec.startswith(("torch==", "transformers==", "accelerate==")):
                probe = subprocess.run([str(python), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                        "-d", tempfile.mkdtemp(), spec], capture_output=True)
                if probe.returncode != 0:
                    unpinned.append(spec)
        log("no wheel for this Python at the image's version, installed unpinned: " + ", ".join(unpinned))
        specs_here = [s.split("==")[0] if s in unpinned else s for s in specs]
        pip(python, "install", "-q", "-c", str(constraint), *specs_here)
    stamp.write_text("\n".join(specs))
    return python


def travelling_copy(dest, bundle):
    """Copy what the device tool sends: tracked files and untracked files git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "-c", "-o", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    count = 0
    for rel in sorted({p for p in listed if p}):
        source, target = ROOT / rel, dest / rel
        if not (source.exists() or source.is_symlink()):
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), target)
        else:
            shutil.copy2(source, target)
        count += 1
    shutil.copytree(bundle, dest / bundle.name)
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", default="device-bundle")
    parser.add_argument("--venv", default=".device-rehearsal-venv")
    parser.add_argument("--out", default="device-rehearsal")
    args = parser.parse_args(argv)
    bundle, venv, out = (Path(p) if Path(p).is_absolute() else ROOT / p for p in (args.bundle, args.venv, args.out))
    manifest = json.loads((bundle / "manifest.json").read_text())
    began = time.monotonic()
    python = make_venv(venv, image_versions(ROOT / "scripts" / "device_image_packages.txt"))
    log(f"venv ready in {time.monotonic() - began:.0f} s")
    # Only the bundle may provide the fork and what the image lacks.
    provided = ["deepspeed"] + [d["name"] for d in manifest["dependencies"]]
    pip(python, "uninstall", "-q", "-y", *provided, check=False)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="device-rehearsal-") as scratch:
        tree = Path(scratch) / "tree"
        files = travelling_copy(tree, bundle)
        log(f"copied the {files} files that travel, and {bundle.name}/, to {tree}")
        env = dict(os.environ, PYTHON=str(python), DEVICE_CHECK_WORK=str(Path(scratch) / "work"))
        # JIT builds of the installed wheel's ops keep their source paths: reuse them between rehearsals.
        env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("DS_HETERO_CACHE",
                                                                         Path.home() / ".cache" / "deepspeed-hetero"))
                                                    / "torch_extensions" / "device-rehearsal"))
        check = ["scripts/device_check.sh", "--rehearsal", "--bundle", bundle.name, str(out)]
        isolated = os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip")
        if isolated:
            # A network namespace with loopback only: proof that nothing is fetched.
            env["GLOO_SOCKET_IFNAME"] = "lo"
            command = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *check]
            log("running the check with no network (a network namespace with loopback only)")
        else:
            command = check
            log("not root: running the check with pip kept off the index (no network namespace)")
        started = time.monotonic()
        rc = subprocess.run(["nice", "-n", "10", *command], cwd=tree, env=env).returncode
    log(f"check exit status {rc}; the check took {time.monotonic() - started:.0f} s, the rehearsal "
        f"{time.monotonic() - began:.0f} s; bundle {manifest['bundle_bytes'] / 2**20:.2f} MiB; results in "
        f"{os.path.relpath(out, ROOT)}/")
    return rc


if __name__ == "__main__":
    sys.exit(main())
