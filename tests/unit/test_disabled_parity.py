"""``heterogeneous_config.enabled = false`` trains bit-identically to upstream DeepSpeed.

The same ZeRO-2 script runs twice on 2 CPU ranks under the real ``deepspeed`` launcher: once
importing the fork, once importing the pinned upstream release unpacked from its sdist. The
parameters after a few steps must be equal bit for bit, so that the fork's hooks, when disabled,
change nothing in what upstream computes.
"""

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import REPO_ROOT, launch_deepspeed

# Backstop only; set-up may build the shm comm op for the fork and for upstream (minutes each).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "zero2_train_steps.py"
STEPS = 4
SEED = 1234


def _initial_parameters():
    spec = importlib.util.spec_from_file_location("zero2_train_steps", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return {name: param.detach().clone() for name, param in script.build_model(SEED).named_parameters()}


def _train(deepspeed_root, env, out):
    """Run the script against the ``deepspeed`` package in ``deepspeed_root``; return its saved state."""
    args = ["--out", out, "--steps", STEPS, "--seed", SEED, "--expect-deepspeed-in", deepspeed_root / "deepspeed"]
    # The working directory too: ``python -m deepspeed.launcher.launch`` puts it first on sys.path.
    code, output = launch_deepspeed(SCRIPT, args, num_ranks=2, timeout=240, env=env, cwd=deepspeed_root)
    assert code == 0, f"training with deepspeed from {deepspeed_root} failed (exit {code}):\n{output[-6000:]}"
    return torch.load(out)


def test_disabled_heterogeneous_config_matches_upstream_bit_for_bit(pristine_upstream, tmp_path):
    runs = {
        "fork": (REPO_ROOT, None),  # launch_deepspeed's default environment is the fork's
        "upstream": (pristine_upstream.root, pristine_upstream.env),
    }
    # Both runs at once: most of each is single-threaded launcher and import time.
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {
            label: pool.submit(_train, root, env, str(tmp_path / f"{label}.pt"))
            for label, (root, env) in runs.items()
        }
        fork, upstream = futures["fork"].result(), futures["upstream"].result()

    # Without this the test could compare the fork with itself and never fail.
    assert Path(fork["deepspeed_file"]).parent == (REPO_ROOT / "deepspeed").resolve()
    assert Path(upstream["deepspeed_file"]).parent == (pristine_upstream.root / "deepspeed").resolve()

    initial = _initial_parameters()
    assert fork["params"].keys() == upstream["params"].keys() == initial.keys()
    assert any(not torch.equal(fork["params"][name], initial[name]) for name in initial), \
        "training did not change any parameter; the comparison would prove nothing"
    differing = {
        name: (fork["params"][name] - upstream["params"][name]).abs().max().item()
        for name in initial if not torch.equal(fork["params"][name], upstream["params"][name])
    }
    assert not differing, (f"parameters differ from upstream {pristine_upstream.version} after {STEPS} ZeRO-2 "
                           f"steps (max abs difference per tensor): {differing}; losses fork {fork['losses']}, "
                           f"upstream {upstream['losses']}")
    assert fork["losses"] == upstream["losses"]
