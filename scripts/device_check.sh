#!/usr/bin/env bash
# One prepared check of the fork's accelerator paths, for a machine with a GPU (never needed by CI).
#
#   scripts/device_check.sh [OUT_DIR]      (default: $OUT, else ./device-check)
#
# What it runs, in about 8 minutes on one GPU:
#   1. the environment: torch, CUDA, the device, its fp16/bf16 support;
#   2. the fork's native op, built for this device (CUDA builder), and its fused un-scale/max-abs
#      against the torch reference on the device;
#   3. every test that needs an accelerator (tests skipped on CPU), plus the native-op, device and
#      scaler unit tests, on the device;
#   4. the collective clock's synchronisation on an asynchronous device (one rank), ZeRO-3
#      twin-flow's resume with its device-side sub-groups (one rank), and the memory model's
#      predicted peak against max_memory_reserved in ZeRO-2 and ZeRO-3 (one rank);
#   5. a short single-GPU training of the small GPT with the fork on: profiling steps, fp16 with the
#      adaptive loss scaler, the heterogeneous profiler's report (memory peaks from the device);
#   6. summary.json and summary.txt in OUT_DIR: one line per stage, passed/failed, with its log.
# It assumes the repository's venv (make install) or an environment with torch and the assembled
# tree installed; set PYTHON to use another interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-device-check}}
mkdir -p "$out"
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/$out/torch_extensions}
results=()

stage() {  # stage NAME TIMEOUT_S COMMAND...: run, log to OUT/NAME.log, record the outcome
  local name=$1 limit=$2; shift 2
  local began=$SECONDS
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  local verdict=passed
  [ $rc -eq 0 ] || verdict="failed (exit $rc)"
  [ $rc -eq 124 ] && verdict="timed out after ${limit}s"
  echo "   $verdict in $((SECONDS - began)) s; last lines:"
  tail -n 4 "$out/$name.log" | sed 's/^/   | /'
  results+=("{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - began)), \"verdict\": \"$verdict\"}")
}

stage environment 60 "$python" - <<'EOF'
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure.devices import describe_local_device
acc = get_accelerator()
print("torch", torch.__version__, "cuda", torch.version.cuda, "accelerator", acc.device_name())
assert acc.device_name() != "cpu", "no accelerator: this check is for a machine with a GPU"
print(describe_local_device(measure=True).to_dict())
EOF

stage native_op 300 "$python" - <<'EOF'
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous import native
device = get_accelerator().current_device_name()
assert native.load_native_op() is not None, native.native_op_status()
print("op:", native.native_op_status())
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    grads = [(torch.randn(n, device=device) * 100).to(dtype) for n in (1, 1000, 1 << 20)]
    grads[1][7] = float("inf")
    fused = native.unscale_maxabs_([g.clone() for g in grads], 1 / 1024)
    reference = native.unscale_maxabs_reference_([g.clone() for g in grads], 1 / 1024)
    print(dtype, "fused", fused, "reference", reference)
    assert fused == reference, (dtype, fused, reference)
print("stream triad GB/s:", native.stream_triad_gbps(device=device))
EOF

stage accelerator_tests 300 "$python" -m pytest -q -rs --timeout=240 \
  tests/unit/heterogeneous/test_fused_unscale.py tests/unit/heterogeneous/test_native.py \
  tests/unit/heterogeneous/test_devices.py tests/unit/heterogeneous/test_adaptive_scaler.py

# On an asynchronous device a collective returns once enqueued, so the fork synchronises
# the device around collectives while micro-steps are timed. One rank (one GPU):
# compute queued before a collective must be counted outside the collective clock, and the
# collective's own time inside it.
stage comm_clock_sync 120 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - <<'EOF'
import time
import torch
import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous import comm_clock
acc = get_accelerator()
deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
device = acc.current_device_name()
a, x = torch.randn(8192, 8192, device=device), torch.ones(1 << 22, device=device)
def compute():
    for _ in range(20):
        a @ a
comm_clock.enable()
dist.all_reduce(x)
acc.synchronize()
began = time.perf_counter(); compute(); acc.synchronize(); alone = time.perf_counter() - began
for on in (False, True):
    assert comm_clock.synchronize_collectives(on) == on, "a CUDA device must count as asynchronous"
    acc.synchronize()
    began = time.perf_counter()
    compute()
    before = comm_clock.seconds_in_collectives()
    dist.all_reduce(x)
    inside = comm_clock.seconds_in_collectives() - before
    acc.synchronize()
    total = time.perf_counter() - began
    print(f"synchronise {on}: compute alone {alone:.4f} s, step {total:.4f} s, inside the clock {inside:.4f} s")
comm_clock.synchronize_collectives(False)
# Synchronised: the queued compute finished before the clock started.
assert inside < 0.2 * total and total - inside >= 0.8 * alone, (alone, total, inside)
EOF

# ZeRO-3 twin-flow (offload_optimizer.ratio 0.5 over four sub-groups) resumes exactly:
# on a GPU the first two sub-groups stay on the device and backup_optimizer (torch's AdamW) steps
# them; zero3-twin-flow-checkpoint.patch keeps their moments in the checkpoint. One rank.
stage twin_flow_resume 300 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29518 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - "$out/twin_flow" <<'EOF'
import sys
import torch
import deepspeed
from deepspeed.ops.adam import DeepSpeedCPUAdam

folder = sys.argv[1]
config = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "sub_group_size": 1,
          "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}
generator = torch.Generator().manual_seed(7)
batches = [(torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)) for _ in range(5)]


def run(first, save_at=None, load=False):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters(),
                                      optimizer=DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.0))
    devices = dict(engine.optimizer.subgroup_to_device)
    assert sorted(devices.values()).count("cpu") == 2, devices  # two sub-groups stay on the device
    if load:
        engine.load_checkpoint(folder, tag="twin")
    for step, (x, y) in enumerate(batches[first:], start=first + 1):
        loss = torch.nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if step == save_at:
            engine.save_checkpoint(folder, tag="twin")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().float().cpu().clone() for p in engine.module.parameters()]


through = run(0, save_at=3)
resumed = run(3, load=True)
diff = max((a - b).abs().max().item() for a, b in zip(through, resumed))
print("resumed vs uninterrupted, largest difference:", diff)
assert diff <= 1e-6, diff
EOF

# The memory model's predicted peak against what the caching allocator reserved
# (max_memory_reserved), ZeRO-2 and ZeRO-3 on one GPU, a 28M-parameter MLP, fp32 Adam. Prints
# the ratio per stage; fails when the device peak is more than 10% above the prediction.
stage memory_peak 300 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29519 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - <<'EOF'
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator

ratios = {}
for stage in (2, 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1536, 1536) for _ in range(12)])
    config = {"train_batch_size": 8, "gradient_clipping": 0,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform"},
              "heterogeneous_memory": {"enabled": True, "zero_partitions": "even", "adaptive_chunking": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = get_accelerator().current_device_name()
    for _ in range(3):
        engine.backward(engine(torch.randn(8, 1536, device=device)).pow(2).mean())
        engine.step()
    state = engine._config.heterogeneous
    placed = state.memory_pool.placement.ranks[0]
    measured = get_accelerator().max_memory_reserved()
    ratios[stage] = measured / placed.predicted_peak_bytes
    print(f"ZeRO-{stage}: predicted {placed.predicted_peak_bytes / 2**20:.0f} MiB ({placed.peak_phase}), "
          f"max_memory_reserved {measured / 2**20:.0f} MiB, ratio {ratios[stage]:.2f}")
    print(state.memory_pool.report())
    del engine
    get_accelerator().empty_cache()
assert all(r <= 1.10 for r in ratios.values()), ratios
EOF

cat >"$out/ds_config.json" <<'EOF'
{
  "train_batch_size": 16,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": true}},
  "fp16": {"enabled": true, "auto_scale_threshold": 0.95},
  "heterogeneous_config": {"enabled": true, "load_balancing_strategy": "compute_aware", "profile_steps": 3}
}
EOF
stage training 300 "$python" -m deepspeed.launcher.runner --num_gpus 1 examples/train_heterogeneous.py \
  --deepspeed_config "$out/ds_config.json" --steps 20 --profile "$out/profile"

{
  printf '{"stages": [%s]}\n' "$(IFS=,; echo "${results[*]}")"
} >"$out/summary.json"
printf '%s\n' "${results[@]}" >"$out/summary.txt"
echo "summary: $out/summary.json"
grep -q '"rc": [1-9]' "$out/summary.json" && exit 1 || exit 0
