# SPDX-License-Identifier: Apache-2.0
"""`make demo`: the heterogeneous environment report, then a short 2-rank training run launched
with the real `deepspeed` launcher on whatever accelerator this machine has (CPU + gloo here).

The config carries a heterogeneous_config block with an emulated mixed cluster; the report shows
what the fork makes of it. (Per-rank micro-batches computed from measured speeds arrive with the
compute-aware load balancer; this run checks the plumbing end to end.)
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# In a source tree, the CPU accelerator takes op builders from the top-level op_builder/ when it
# is importable and from deepspeed/ops/op_builder/ otherwise; they compile different copies of
# csrc/, and ninja rebuilds an op (minutes on two cores) whenever the two alternate. Every
# process of the demo therefore sees the tree's root, as the tests do.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))}

DEMO_CONFIG = {
    "train_batch_size": 16,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "heterogeneous_config": {
        "enabled": True,
        "load_balancing_strategy": "compute_aware",
        "profile_steps": 3,
        "scheduler": {"dynamic_rebalancing": False, "imbalance_threshold": 0.1, "check_interval": 20},
        "emulation": {"speeds": [1.0, 0.4], "memory_gb": [16, 8], "mode": "auto"},
    },
}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def banner(text):
    print(f"\n=== {text} " + "=" * max(0, 76 - len(text)), flush=True)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "ds_config.json"
        config.write_text(json.dumps(DEMO_CONFIG, indent=2))

        banner("deepspeed env_report --heterogeneous --config ds_config.json")
        report = subprocess.run([str(BIN / "deepspeed"), "env_report", "--heterogeneous", "--config", str(config)],
                                env=ENV)
        if report.returncode != 0:
            return report.returncode

        banner("deepspeed --num_gpus 2 examples/train_heterogeneous.py (2 ranks)")
        start = time.time()
        train = subprocess.run([
            str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
            str(HERE / "train_heterogeneous.py"), "--deepspeed_config", str(config), "--steps", "20"
        ], capture_output=True, text=True, timeout=1800, env=ENV)
        for line in (train.stdout + train.stderr).splitlines():
            if line.startswith(("[demo]", "{")) or "Error" in line or "error:" in line:
                print(line)
        if train.returncode != 0:
            print(f"training failed (exit {train.returncode}); the full output follows:\n{train.stdout}{train.stderr}")
            return train.returncode
        banner(f"done in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
