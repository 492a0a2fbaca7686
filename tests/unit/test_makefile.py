"""Where ``make`` installs torch from, read from its dry run (``make -n``), so nothing is installed."""

import os
import shutil
import subprocess

import pytest

from harness import REPO_ROOT

CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _torch_install_line(tmp_path, find_links, *make_args):
    """The pip command that would install torch into a venv that does not exist yet."""
    env = {name: value for name, value in os.environ.items() if name not in ("PIP_FIND_LINKS", "TORCH_INDEX_URL")}
    if find_links is not None:
        env["PIP_FIND_LINKS"] = find_links
    venv = tmp_path / ".venv"
    proc = subprocess.run(["make", "-n", f"VENV={venv}", *make_args, f"{venv}/.torch"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    lines = [line for line in proc.stdout.splitlines() if " install " in line and "torch==" in line]
    assert len(lines) == 1, proc.stdout
    return lines[0]


def test_local_wheels_decide_where_torch_comes_from(tmp_path):
    line = _torch_install_line(tmp_path, "/opt/wheels")
    assert "--index-url" not in line and "download.pytorch.org" not in line


def test_without_local_wheels_torch_comes_from_the_cpu_index(tmp_path):
    assert f'--index-url "{CPU_INDEX}"' in _torch_install_line(tmp_path, None)


def test_a_given_torch_index_is_used(tmp_path):
    cuda_index = "https://download.pytorch.org/whl/cu126"
    for find_links in (None, "/opt/wheels"):
        line = _torch_install_line(tmp_path, find_links, f"TORCH_INDEX_URL={cuda_index}")
        assert f'--index-url "{cuda_index}"' in line and CPU_INDEX not in line


def test_an_empty_torch_index_leaves_pip_its_own_configuration(tmp_path):
    assert "--index-url" not in _torch_install_line(tmp_path, None, "TORCH_INDEX_URL=")


def test_only_torch_gets_the_torch_index(tmp_path):
    venv = tmp_path / ".venv"
    env = {name: value for name, value in os.environ.items() if name != "PIP_FIND_LINKS"}
    proc = subprocess.run(["make", "-n", f"VENV={venv}", f"{venv}/.torch"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    others = [line for line in proc.stdout.splitlines() if " install " in line and "torch==" not in line]
    assert others and not any("download.pytorch.org" in line for line in others)
