#!/usr/bin/env bash
# One prepared check of the fork's accelerator paths, for a machine with a GPU (never needed by CI).
#
#   scripts/device_check.sh [--bundle DIR] [--rehearsal] [OUT_DIR]     (OUT_DIR default: $OUT, else ./device-check)
#
# --bundle DIR   first install DIR (make device-bundle: the fork's wheel and the wheels the GPU
#                image lacks) into the interpreter with pip --no-index: no network is used. Without
#                it the check runs against the assembled tree (make install) or what PYTHON has.
# --rehearsal    no GPU here (make device-rehearsal): every stage that can runs on the CPU, with its
#                device-only assertions reported as not checked; stages that need CUDA are skipped.
#
# On the GPU machine (no network; its python3 holds torch 2.11):
#   scripts/device_check.sh --bundle device-bundle "$OUT"          (about 8 minutes, DEVICE_CHECK_BUDGET_S)
#
# What it runs, in this order (the most telling first, should the time budget run out):
#   bundle            install the bundle; say whether it was made from the tree it runs in;
#   environment       python, torch, CUDA, NCCL, nvcc, the device, the installed fork and its dependencies;
#   native_op         the fork's native op, JIT-built for this device (nvcc), its fused un-scale/max-abs
#                     against the torch reference on the device;
#   memory_peak       the memory model's predicted peak against max_memory_reserved, ZeRO-2 and ZeRO-3;
#   comm_clock_sync   the collective clock's synchronisation on an asynchronous device (one rank);
#   training          a short single-GPU training of the small GPT through the launcher: profiling
#                     steps, fp16 with the adaptive loss scaler, the profiler's report;
#   two_ranks         two ranks on the one GPU, split [12, 4], ZeRO-0 and ZeRO-2, against a single-process
#                     reference: over NCCL if it accepts two ranks on one device, else gloo with CUDA tensors;
#   twin_flow_resume  ZeRO-3 twin-flow's resume with its device-side sub-groups (one rank);
#   accelerator_tests the tests the CPU run skips, with the native-op, device and scaler unit tests.
# OUT_DIR receives summary.json, summary.txt and stages.log (every stage's log), plus the profiler's
# profile.json and timeline.png: few files, as the device tool returns at most 8. Scratch files
# (JIT builds, checkpoints) go to DEVICE_CHECK_WORK (default: a new folder under /tmp).
# Exit status: 0 when no stage failed (skipped stages do not fail the run).
set -uo pipefail
cd "$(dirname "$0")/.."

bundle= rehearsal=${DEVICE_CHECK_REHEARSAL:-0}
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) bundle=${2:?--bundle needs a folder}; shift 2 ;;
    --bundle=*) bundle=${1#--bundle=}; shift ;;
    --rehearsal) rehearsal=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    -*) echo "device_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) break ;;
  esac
done
out=${1:-${OUT:-device-check}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
work=${DEVICE_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/device-check.XXXXXX")}
mkdir -p "$work/logs" && work=$(cd "$work" && pwd)
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# Stages share one time budget: a stage gets its own limit or what is left, whichever is less.
if [ "$rehearsal" = 1 ]; then
  budget=${DEVICE_CHECK_BUDGET_S:-3600} scale=4   # CPU: cold JIT builds of the CPU ops on few cores
else
  budget=${DEVICE_CHECK_BUDGET_S:-480} scale=1
fi
deadline=$((SECONDS + budget))
if [ -n "$bundle" ]; then
  bundle=$(cd "$bundle" && pwd) || exit 2
  # The tree here holds the fork's own files but not upstream's: deepspeed comes from the bundle.
  export PYTHONPATH=${PYTHONPATH:-}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 DEVICE_CHECK_REHEARSAL=$rehearsal DEVICE_CHECK_WORK=$work
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$work/torch_extensions}
# pip never reaches an index here, whatever the machine's configuration says.
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT
: >"$work/results.tsv"
echo "device check: mode $([ "$rehearsal" = 1 ] && echo "rehearsal (no GPU)" || echo device), python $python," \
     "bundle ${bundle:-none}, budget ${budget}s, out $out, work $work"

record() {  # record NAME STATUS RC SECONDS VERDICT
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$work/results.tsv"
  echo "   $5 (${4} s)"
}

stage() {  # stage NAME LIMIT_S [--needs-gpu] COMMAND...: run under the budget, log to WORK/logs/NAME.log
  local name=$1 limit=$(($2 * scale)); shift 2
  local needs_gpu=0
  [ "${1:-}" = --needs-gpu ] && { needs_gpu=1; shift; }
  local log=$work/logs/$name.log began=$SECONDS left=$((deadline - SECONDS))
  echo "== $name"
  if [ $needs_gpu = 1 ] && [ "$rehearsal" = 1 ]; then
    echo "skipped: no GPU (rehearsal)" >"$log"
    record "$name" skipped 0 0 "skipped: no GPU (rehearsal)"
    return
  fi
  if [ $left -lt 20 ]; then
    echo "skipped: ${left}s left of the ${budget}s budget" >"$log"
    record "$name" skipped 0 0 "skipped: out of the ${budget}s time budget"
    return
  fi
  [ $limit -gt $((left - 5)) ] && limit=$((left - 5))
  timeout -k 10 "$limit" "$@" >"$log" 2>&1
  local rc=$? status verdict
  # A line 'UNCHECKED: what' in a stage's output names a device-only assertion a CPU cannot make.
  local unchecked
  unchecked=$(sed -n 's/^UNCHECKED: //p' "$log" | paste -sd ';' - | sed 's/;/; /g')
  if [ $rc -eq 0 ]; then
    status=passed verdict=passed
    [ -n "$unchecked" ] && verdict="passed (rehearsal, on the CPU; not checked: $unchecked)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    status=failed verdict="timed out after ${limit}s"
  else
    status=failed verdict="failed (exit $rc)"
  fi
  record "$name" "$status" "$rc" $((SECONDS - began)) "$verdict"
  [ $rc -eq 0 ] || tail -n 6 "$log" | sed 's/^/   | /'
}

if [ -n "$bundle" ]; then
  # Install the fork and the wheels the image lacks, into the interpreter (as root on the GPU
  # machine; the machine starts bare each time). Where that is refused, into WORK/site instead.
  stage bundle 120 "$python" - "$bundle" "$work/site" <<'EOF'
import hashlib, json, os, subprocess, sys
bundle, site = sys.argv[1], sys.argv[2]
manifest = json.load(open(os.path.join(bundle, "manifest.json")))
fork = manifest["fork"]
print(f"bundle: made {manifest['created']} from {fork['git_head']}, {len(manifest['files'])} wheels, "
      f"{manifest['bundle_bytes'] / 2**20:.2f} MiB")
stale = []
for rel, digest in fork["tree_files"].items():
    if not os.path.isfile(rel) or hashlib.sha256(open(rel, "rb").read()).hexdigest() != digest:
        stale.append(rel)
if stale:
    print(f"STALE: the bundle's wheel was built from other fork files than this tree holds ({len(stale)}: "
          f"{', '.join(stale[:8])}{' ...' if len(stale) > 8 else ''}); rebuild it with make device-bundle")
else:
    print(f"the bundle matches this tree's {len(fork['tree_files'])} fork files")
names = [f"deepspeed=={fork['version']}"] + [f"{d['name']}=={d['version']}" for d in manifest["dependencies"]]
pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", bundle, "--no-cache-dir",
       "--disable-pip-version-check", "--no-warn-script-location"]
print("$", " ".join(pip + names), flush=True)
if subprocess.run(pip + names).returncode != 0:
    print(f"installing into the interpreter failed; installing into {site} instead (--target, --no-deps)", flush=True)
    subprocess.run(pip + ["--no-deps", "--target", site] + names, check=True)
    print(f"TARGET_SITE={site}")
sys.exit(3 if stale else 0)
EOF
  site=$(sed -n 's/^TARGET_SITE=//p' "$work/logs/bundle.log")
  [ -n "$site" ] && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi

stage environment 60 "$python" - "$bundle" <<'EOF'
import importlib.metadata, json, os, shutil, subprocess, sys
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure.devices import describe_local_device
rehearsal = os.environ["DEVICE_CHECK_REHEARSAL"] == "1"
acc = get_accelerator()
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "accelerator", acc.device_name())
try:
    print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
except Exception as exc:  # a CPU-only torch has no NCCL
    print("nccl: none", type(exc).__name__)
nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
print("nvcc", subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
      if nvcc else "not found")
print("deepspeed", deepspeed.__version__, "from", os.path.dirname(deepspeed.__file__))
for name in ("pydantic", "pydantic-core", "hjson", "numpy", "ninja", "psutil", "transformers", "accelerate"):
    try:
        print(" ", name, importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        print(" ", name, "not installed")
if sys.argv[1]:  # from the bundle: the installed wheel, never the partial tree here
    version = json.load(open(os.path.join(sys.argv[1], "manifest.json")))["fork"]["version"]
    assert deepspeed.__version__ == version, (deepspeed.__version__, version)
    assert not os.path.abspath(deepspeed.__file__).startswith(os.getcwd() + os.sep), deepspeed.__file__
if acc.device_name() == "cpu":
    assert rehearsal, "no accelerator: this check is for a machine with a GPU"
    print("UNCHECKED: the GPU itself")
else:
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, capability {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
          f"{props.multi_processor_count} SMs, bf16 {torch.cuda.is_bf16_supported()}")
print(describe_local_device(measure=True).to_dict())
EOF

stage native_op 180 "$python" - <<'EOF'
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure import native
device = get_accelerator().current_device_name()
assert native.load_native_op() is not None, native.native_op_status()
print("op:", native.native_op_status(), "on", device)
for dtype in (torch.float16, torch.bfloat16, torch.float32):
    grads = [(torch.randn(n, device=device) * 100).to(dtype) for n in (1, 1000, 1 << 20)]
    grads[1][7] = float("inf")
    fused = native.unscale_maxabs_([g.clone() for g in grads], 1 / 1024)
    reference = native.unscale_maxabs_reference_([g.clone() for g in grads], 1 / 1024)
    print(dtype, "fused", fused, "reference", reference)
    assert fused == reference, (dtype, fused, reference)
print("stream triad GB/s:", native.stream_triad_gbps(device=device))
EOF

# The memory model's predicted peak against what the caching allocator reserved
# (max_memory_reserved), ZeRO-2 and ZeRO-3 on one GPU, a 28M-parameter MLP, fp32 Adam. Prints
# the ratio per stage; fails when the device peak is more than 10% above the prediction.
stage memory_peak 150 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29519 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - <<'EOF'
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator

acc = get_accelerator()
on_device = acc.device_name() != "cpu"
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
    device = acc.current_device_name()
    for _ in range(3):
        engine.backward(engine(torch.randn(8, 1536, device=device)).pow(2).mean())
        engine.step()
    state = engine._config.heterogeneous
    placed = state.memory_pool.placement.ranks[0]
    measured = acc.max_memory_reserved()
    ratios[stage] = measured / placed.predicted_peak_bytes
    print(f"ZeRO-{stage}: predicted {placed.predicted_peak_bytes / 2**20:.0f} MiB ({placed.peak_phase}), "
          f"max_memory_reserved {measured / 2**20:.0f} MiB, ratio {ratios[stage]:.2f}")
    print(state.memory_pool.report())
    del engine
    acc.empty_cache()
    if on_device:
        acc.reset_peak_memory_stats()
if on_device:
    assert all(r <= 1.10 for r in ratios.values()), ratios
else:
    print("UNCHECKED: the predicted peak against a device allocator's max_memory_reserved")
EOF

# On an asynchronous device a collective returns once enqueued, so the fork synchronises
# the device around collectives while micro-steps are timed. One rank (one GPU):
# compute queued before a collective must be counted outside the collective clock, and the
# collective's own time inside it.
stage comm_clock_sync 90 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29517 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - <<'EOF'
import time
import torch
import deepspeed
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.heterogeneous.measure import comm_clock
acc = get_accelerator()
on_device = acc.device_name() != "cpu"
deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
device = acc.current_device_name()
n = 8192 if on_device else 256  # a CPU is synchronous: only the code path is exercised there
a, x = torch.randn(n, n, device=device), torch.ones(1 << 22, device=device)
def compute():
    for _ in range(20):
        a @ a
comm_clock.enable()
dist.all_reduce(x)
acc.synchronize()
began = time.perf_counter(); compute(); acc.synchronize(); alone = time.perf_counter() - began
for on in (False, True):
    synchronising = comm_clock.synchronize_collectives(on)
    assert synchronising == (on and on_device), ("a CUDA device must count as asynchronous, a CPU as synchronous",
                                                  on, synchronising)
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
if on_device:  # synchronised: the queued compute finished before the clock started
    assert inside < 0.2 * total and total - inside >= 0.8 * alone, (alone, total, inside)
else:
    print("UNCHECKED: compute queued on an asynchronous device kept out of the collective clock")
EOF

# The small GPT through the launcher: profiling steps, fp16 with the adaptive loss scaler, the
# profiler's report with the device's memory peaks. A CPU has no fp16 matrix products here: the
# rehearsal trains in bf16 (no loss scaler).
if [ "$rehearsal" = 1 ]; then
  precision='"bf16": {"enabled": true}'
else
  precision='"fp16": {"enabled": true, "auto_scale_threshold": 0.95}'
fi
cat >"$work/ds_config.json" <<EOF
{
  "train_batch_size": 16,
  "gradient_clipping": 1.0,
  "optimizer": {"type": "Adam", "params": {"lr": 0.001, "torch_adam": true}},
  $precision,
  "heterogeneous_config": {"enabled": true, "load_balancing_strategy": "compute_aware", "profile_steps": 3}
}
EOF
training() {
  [ "$DEVICE_CHECK_REHEARSAL" = 1 ] && echo "UNCHECKED: fp16 with the adaptive loss scaler (bf16 on the CPU)"
  "$python" -m deepspeed.launcher.runner --num_gpus 1 --master_port 29521 examples/train_heterogeneous.py \
    --deepspeed_config "$work/ds_config.json" --steps 20 --profile "$work/profile" || return
  grep -q '"summary": true' "$work/logs/training.log" || { echo "no summary line"; return 1; }
}
export -f training; export python work
stage training 180 bash -c training

# Two ranks on the one GPU: NCCL refuses two ranks on one device ("Duplicate GPU"), which a probe
# finds out; then gloo, which reduces CUDA tensors through the host. Each rank computes its own
# share of a global batch of 16 ([12, 4], manual strategy), and the parameters must equal a
# single-process run on the whole batch. In the rehearsal: CPU ranks, gloo.
cat >"$work/two_ranks_rank.py" <<'EOF'
import argparse, os, sys
parser = argparse.ArgumentParser()
parser.add_argument("--probe", action="store_true")
parser.add_argument("--backend", default="gloo")
parser.add_argument("--zero", type=int, default=0)
parser.add_argument("--out")
args = parser.parse_args()
import torch
if torch.cuda.is_available():
    os.environ["LOCAL_RANK"] = "0"  # both ranks on the one GPU
    torch.cuda.set_device(0)
if args.probe:  # can this backend put two ranks on one device?
    import torch.distributed as tdist
    tdist.init_process_group(args.backend)
    t = torch.ones(4, device="cuda:0")
    tdist.all_reduce(t)
    torch.cuda.synchronize()
    assert t[0].item() == tdist.get_world_size(), t
    tdist.destroy_process_group()
    sys.exit(0)
import deepspeed
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_ranks_common import SPLIT, batches, make_model
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
deepspeed.init_distributed(dist_backend=args.backend)
rank = int(os.environ["RANK"])
model = make_model()
config = {"train_batch_size": sum(SPLIT), "gradient_clipping": 0.0,  # the default clips at 1.0
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
          "zero_optimization": {"stage": args.zero},
          "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual", "micro_batch_sizes": SPLIT}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
assert engine.train_micro_batch_size_per_gpu() == SPLIT[rank], engine.train_micro_batch_size_per_gpu()
first = sum(SPLIT[:rank])
for x, y in batches():
    x, y = x[first:first + SPLIT[rank]].to(engine.device), y[first:first + SPLIT[rank]].to(engine.device)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
if rank == 0:
    torch.save([p.detach().float().cpu() for p in engine.module.parameters()], args.out)
print(f"rank {rank}: device {engine.device}, micro-batch {SPLIT[rank]}, backend {args.backend}, ZeRO-{args.zero}")
EOF
cat >"$work/two_ranks_common.py" <<'EOF'
import torch
SPLIT = [12, 4]
def make_model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
def batches(steps=5):
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(sum(SPLIT), 32, generator=generator), torch.randn(sum(SPLIT), 1, generator=generator))
            for _ in range(steps)]
EOF
stage two_ranks 180 "$python" - "$work" <<'EOF'
import os, subprocess, sys
import torch
work = sys.argv[1]
sys.path.insert(0, work)
from two_ranks_common import batches, make_model
on_device = torch.cuda.is_available()
script = os.path.join(work, "two_ranks_rank.py")
def ranks(*args, timeout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return False, f"timed out after {timeout}s: {(exc.stdout or '')[-1500:]}"
    return proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
backend = "gloo"
if on_device:
    ok, output = ranks("--probe", "--backend", "nccl", timeout=90)
    if ok:
        backend = "nccl"
        print("NCCL: two ranks on one GPU accepted; the ranks train over NCCL")
    else:
        why = [line for line in output.splitlines() if "Duplicate GPU" in line or "Error" in line or "error" in line]
        print("NCCL refused two ranks on one GPU:", (why or output.splitlines()[-1:] or ["?"])[-1].strip())
        print("the ranks train over gloo with CUDA tensors (reduced through the host)")
else:
    print("UNCHECKED: two ranks on one GPU (NCCL, or gloo with CUDA tensors): CPU ranks over gloo")
# The reference: one process, the whole global batch, the same initial model and optimiser.
device = "cuda:0" if on_device else "cpu"
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
model = make_model().to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.0)
for x, y in batches():
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
    optimizer.step()
reference = [p.detach().float().cpu() for p in model.parameters()]
failures = []
for zero in (0, 2):
    result = os.path.join(work, f"two_ranks_zero{zero}.pt")
    ok, output = ranks("--backend", backend, "--zero", str(zero), "--out", result, timeout=150)
    if not ok:
        print(f"ZeRO-{zero} over {backend}: FAILED\n{output}")
        failures.append(zero)
        continue
    got = torch.load(result)
    diff = max((a - b).abs().max().item() for a, b in zip(got, reference))
    verdict = "equal to the single-process run" if diff <= 2e-5 else "DIFFERS from the single-process run"
    print(f"ZeRO-{zero} over {backend}, split [12, 4]: largest parameter difference {diff:.3g}: {verdict}")
    if diff > 2e-5:
        failures.append(zero)
sys.exit(1 if failures else 0)
EOF

# ZeRO-3 twin-flow (offload_optimizer.ratio 0.5 over four sub-groups) resumes exactly:
# on a GPU the first two sub-groups stay on the device and backup_optimizer (torch's AdamW) steps
# them; zero3-twin-flow-checkpoint.patch keeps their moments in the checkpoint. One rank.
stage twin_flow_resume 180 env MASTER_ADDR=127.0.0.1 MASTER_PORT=29518 RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 \
  "$python" - "$work/twin_flow" <<'EOF'
import sys
import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam

on_device = get_accelerator().device_name() != "cpu"
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
    print("sub-groups:", devices)
    if on_device:
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
if not on_device:
    print("UNCHECKED: device-side sub-groups (on a CPU every sub-group is on the host)")
EOF

# The tests that need an accelerator (skipped on a CPU), with the native-op, device and scaler
# unit tests. The multi-process ones run CPU ranks over gloo, as in CI: not here.
stage accelerator_tests 150 "$python" -m pytest -q -rs -p no:cacheprovider --timeout=240 -m "not multiprocess" \
  tests/unit/heterogeneous/test_fused_unscale.py tests/unit/heterogeneous/test_native.py \
  tests/unit/heterogeneous/test_devices.py tests/unit/heterogeneous/test_adaptive_scaler.py

# The summary: summary.json (per stage: status, rc, seconds, verdict), summary.txt (a table), and
# stages.log (each stage's log under a header), plus the profiler's files where the training wrote them.
for f in "$work"/logs/*.log; do
  printf '\n===== %s =====\n' "$(basename "$f" .log)"
  cat "$f"
done >"$out/stages.log"
for f in profile.json timeline.png; do [ -f "$work/profile/$f" ] && cp "$work/profile/$f" "$out/$f"; done
"$python" - "$work/results.tsv" "$out" "$([ "$rehearsal" = 1 ] && echo rehearsal || echo device)" "$budget" \
  "$SECONDS" <<'EOF'
import json, os, platform, sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
stages = [{"stage": n, "status": s, "rc": int(rc), "seconds": int(sec), "verdict": v} for n, s, rc, sec, v in rows]
summary = {"mode": sys.argv[3], "host": platform.node(), "budget_s": int(sys.argv[4]), "wall_s": int(sys.argv[5]),
           "passed": all(s["status"] != "failed" for s in stages), "stages": stages}
with open(os.path.join(sys.argv[2], "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
    f.write("\n")
width = max(len(s["stage"]) for s in stages)
with open(os.path.join(sys.argv[2], "summary.txt"), "w") as f:
    f.write(f"device check ({summary['mode']}), {summary['wall_s']} s of a {summary['budget_s']} s budget: "
            f"{'PASSED' if summary['passed'] else 'FAILED'}\n")
    for s in stages:
        f.write(f"{s['stage']:<{width}}  {s['seconds']:>4} s  {s['verdict']}\n")
EOF
cat "$out/summary.txt"
echo "summary: $out/summary.json"
grep -q $'\tfailed\t' "$work/results.tsv" && exit 1 || exit 0
