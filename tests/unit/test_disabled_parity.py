"""``heterogeneous_config.enabled = false`` trains bit-identically to upstream DeepSpeed.

One script trains a small model a few steps in several configurations (ZeRO 0, 1, 2 and 3; fp32
and bf16; gradient accumulation 1 and 2; batches fed by hand and by the loader that
``deepspeed.initialize(training_data=...)`` returns) on 2 CPU ranks under the real
``deepspeed`` launcher, twice: once importing the fork, once importing the pinned upstream
release unpacked from its sdist. Every case's parameters must be equal bit for bit, as must the
losses and the samples the loader handed out, so that the fork's hooks, when disabled, change
nothing in what upstream computes. One ZeRO-2 case leaves ``heterogeneous_config`` out altogether,
and must equal the same case with the block present and disabled.
"""

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness import REPO_ROOT, launch_deepspeed

# Backstop only; set-up may build the shm comm op for the fork and for upstream (minutes each).
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "disabled_parity_train.py"
STEPS = 3
SEED = 1234


def _load_script():
    spec = importlib.util.spec_from_file_location("disabled_parity_train", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


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

    script = _load_script()
    initial = {name: param.detach() for name, param in script.build_model(SEED).named_parameters()}
    assert fork["cases"].keys() == upstream["cases"].keys() == script.CASES.keys()
    mismatches = [_mismatch(name, case, fork["cases"][name], upstream["cases"][name], initial)
                  for name, case in script.CASES.items()]
    mismatches = [line for line in mismatches if line]
    assert not mismatches, (f"fork with heterogeneous_config disabled differs from upstream "
                            f"{pristine_upstream.version} after {STEPS} steps:\n" + "\n".join(mismatches))
    # Absent and disabled are the same to the fork: both are upstream.
    absent, disabled = fork["cases"]["zero2-fp32-absent"]["params"], fork["cases"]["zero2-fp32"]["params"]
    assert all(torch.equal(absent[key], disabled[key]) for key in initial)


def _mismatch(name, case, ours, theirs, initial):
    """How the fork's results of one case differ from upstream's, or None; asserts the case can fail."""
    assert ours["params"].keys() == theirs["params"].keys() == initial.keys(), name
    assert any(not torch.equal(value, initial[key].to(value.dtype)) for key, value in ours["params"].items()), \
        f"{name}: training did not change any parameter; the comparison would prove nothing"
    # The optimizer's fp32 masters too: in bf16, a difference can hide below the rounding of the
    # bf16 parameters for a few steps. Only ZeRO-0 fp32 has none.
    assert ours["master"] or (case["stage"] == 0 and case["dtype"] == "fp32"), f"{name}: no fp32 masters"
    assert ours["master"].keys() == theirs["master"].keys(), name
    if case["loader"]:
        assert len(ours["seen"]) == STEPS * case["gas"] and all(ours["seen"]), f"{name}: the loader gave no samples"
    differing = {
        f"{kind} {key}": (ours[kind][key].float() - theirs[kind][key].float()).abs().max().item()
        for kind in ("params", "master")
        for key in ours[kind] if not torch.equal(ours[kind][key], theirs[kind][key])
    }
    if differing:
        return (f"{name}: parameters differ (max abs difference per tensor) {differing}; losses fork "
                f"{ours['losses']}, upstream {theirs['losses']}")
    if ours["losses"] != theirs["losses"] or ours["seen"] != theirs["seen"]:
        return (f"{name}: losses fork {ours['losses']}, upstream {theirs['losses']}; samples fork "
                f"{ours['seen']}, upstream {theirs['seen']}")
    return None
