# SPDX-License-Identifier: Apache-2.0
"""`make demo`: heterogeneous training of a small GPT on an emulated 2-rank cluster.

Rank 0 runs at full speed, rank 1 at 0.4 (a CPU-quota cgroup where the machine allows it, else
time dilation). The demo prints the environment report, then trains twice with the real
`deepspeed` launcher, first with the uniform split (upstream's behaviour), then compute-aware,
and compares throughput and the two loss curves: the global batch, its order and the model are
the same, so the curves must agree; only who computes what changes.
"""

import glob
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
STEPS = 40


def demo_config(strategy):
    return {
        "train_batch_size": 16,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "heterogeneous_config": {
            "enabled": True,
            "load_balancing_strategy": strategy,
            "profile_steps": 3,
            "emulation": {"speeds": [1.0, 0.4], "memory_gb": [16, 8], "mode": "auto"},
        },
    }


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def banner(text):
    print(f"\n=== {text} " + "=" * max(0, 76 - len(text)), flush=True)


def shown(line):
    """The launcher's lines the demo passes on: the fork's plan blocks (titles, what changed, the
    tables, their notes and the emulation line) and op builds, which take minutes the first time."""
    text = line.strip()
    return (line.startswith("[deepspeed-hetero]") or text.startswith(("rank ", "strategy ", "note:", "emulated:",
                                                                       "micro-batches ", "warning:"))
            or text.split(" ", 1)[0] in ("0", "1") or text.startswith("DeepSpeed: building op"))


def train(config_path):
    """Launch 2 ranks, passing the plan blocks on as they come; returns (per-step records, summary)."""
    port = free_port()
    records, summary, output = [], None, []
    try:
        proc = subprocess.Popen([
            str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
            str(HERE / "train_heterogeneous.py"), "--deepspeed_config", str(config_path), "--steps", str(STEPS)
        ], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
        for line in proc.stdout:
            line = line.rstrip("\n")
            output.append(line)
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("summary"):
                    summary = record
                else:
                    records.append(record)
            elif shown(line):
                print(line, flush=True)
        returncode = proc.wait(timeout=1800)
    finally:
        # The fork unlinks the CPU all-reduce's 66 MiB /dev/shm buffers once every rank has mapped
        # them (patches/cpu-shm-unlink-buffers.patch); a rank killed before that leaves its own.
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.unlink(path)
    if returncode != 0 or summary is None:
        print(f"training failed (exit {returncode}); its output follows:\n" + "\n".join(output))
        raise SystemExit(returncode or 1)
    return records, summary


def main():
    with tempfile.TemporaryDirectory() as tmp:
        configs = {}
        for strategy in ("uniform", "compute_aware"):
            configs[strategy] = Path(tmp) / f"{strategy}.json"
            configs[strategy].write_text(json.dumps(demo_config(strategy), indent=2))

        banner("deepspeed env_report --heterogeneous --config compute_aware.json")
        report = subprocess.run([str(BIN / "deepspeed"), "env_report", "--heterogeneous", "--config",
                                 str(configs["compute_aware"])], env=ENV)
        if report.returncode != 0:
            return report.returncode

        results = {}
        for strategy in ("uniform", "compute_aware"):
            banner(f"training, {strategy} split (2 ranks, speeds [1.0, 0.4], {STEPS} steps)")
            start = time.time()
            records, summary = train(configs[strategy])
            results[strategy] = (records, summary)
            for record in records[::8] + records[-1:]:
                print(f"step {record['step']:3d}  loss {record['loss']:.4f}  plan {record['plan']}")
            print(f"{summary['samples_per_s']:.1f} samples/s after start-up, emulation by {summary['emulation']}, "
                  f"{time.time() - start:.0f} s in all")

        banner("summary")
        uniform, aware = results["uniform"], results["compute_aware"]
        speedup = aware[1]["samples_per_s"] / uniform[1]["samples_per_s"]
        gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(uniform[0], aware[0]))
        print(f"plan: uniform {uniform[0][-1]['plan']} -> compute-aware {aware[0][-1]['plan']}")
        print(f"samples/s: uniform {uniform[1]['samples_per_s']:.1f}, compute-aware {aware[1]['samples_per_s']:.1f}, "
              f"speedup {speedup:.2f}x")
        print(f"loss curves: first {uniform[0][0]['loss']:.4f}, last {uniform[0][-1]['loss']:.4f} (uniform) vs "
              f"{aware[0][-1]['loss']:.4f} (compute-aware); largest difference over {STEPS} steps: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
