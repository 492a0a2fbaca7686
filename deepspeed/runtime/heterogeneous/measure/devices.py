# SPDX-License-Identifier: Apache-2.0
"""What each rank's device is and how fast it should be, before anything is measured on the model.

A built-in table of datasheet rates (``device_table.py``, each entry with its source) gives known
accelerators a prior score; an unknown device (the CPU included) gets a short benchmark instead (``device_benchmark.py``), reported in the same
unit (TFLOP/s) so that the two kinds of score can sit side by side in one plan. Profiling on the
real model replaces both later (docs/balancing.md, "The start-up plan").

The runtime (``cluster/ranks.gather_devices``) and ``ds_report --heterogeneous`` both describe a
rank's device with ``describe_local_device`` at ``local_device_index`` / ``local_device_count``,
with ``emulated_memory_bytes`` in place of the capacity; ``rank_memory_capacity`` is what one rank
may use of it. On the CPU accelerator a memory cgroup limit below the host's RAM is the capacity
(``cpu_memory_capacity``).
"""

import contextlib
import math
import os
import platform
import re
import socket
from dataclasses import MISSING, asdict, dataclass, fields

import torch

from deepspeed.accelerator import get_accelerator

from .device_benchmark import measure_device_score
from .device_table import ACCELERATOR_SPECS, AcceleratorSpec  # noqa: F401 -- re-exported, one table


# GPU vendors' "GB" in device names and datasheets is GiB: an "A100 80GB" reports 80 GiB.
BYTES_PER_GB = 2**30


# Tokens of device names that say nothing about the rates. Any other token that is not a known
# model makes the lookup fail: "RTX 3090 Ti" or "A10G" are different chips, and an honest
# measurement beats borrowing a sibling's datasheet.
_NEUTRAL_TOKENS = frozenset({
    "nvidia", "tesla", "geforce", "rtx", "amd", "instinct", "sxm", "sxm2", "sxm4", "sxm5", "dgxs", "oam",
    "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6", "gddr6x", "vf"
})
_FORM_FACTOR_TOKENS = ("pcie", "nvl")
_MEMORY_TOKEN = re.compile(r"(\d+)gb")


def find_spec(device_name, memory_bytes=None):
    """The datasheet entry for a device name as torch reports it, or None when unknown.

    Args:
        device_name: e.g. "NVIDIA A100-SXM4-80GB", "Tesla V100-PCIE-16GB", "AMD Instinct MI300X".
        memory_bytes: the device's capacity; picks between memory variants (A100 40GB/80GB)
            when the name does not say. Default None: the name decides, else the first variant.
    """
    tokens = re.findall(r"[a-z0-9]+", device_name.lower())
    name_memory_gb = None
    model_tokens = set()
    form_factor = ""
    for token in tokens:
        memory_match = _MEMORY_TOKEN.fullmatch(token)
        if memory_match:
            name_memory_gb = int(memory_match.group(1))
        elif token in _FORM_FACTOR_TOKENS:
            form_factor = token
        elif token not in _NEUTRAL_TOKENS:
            model_tokens.add(token)
    if not model_tokens:
        return None
    candidates = [
        spec for spec in ACCELERATOR_SPECS
        if model_tokens <= set(spec.aliases) and spec.form_factor == form_factor
    ]
    if not candidates:
        return None
    memory_gb = name_memory_gb if name_memory_gb is not None else (
        memory_bytes / BYTES_PER_GB if memory_bytes else None)
    if memory_gb is None:
        return candidates[0]
    return min(candidates, key=lambda spec: abs(spec.memory_gb - memory_gb))


_DTYPE_KEYS = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
}
# A dtype the device cannot run falls back to the next one, as training would.
_DTYPE_FALLBACK = ("bf16", "fp16", "fp32")


def spec_score(spec, dtype=None):
    """Peak dense TFLOP/s of `spec` for training in `dtype`.

    Args:
        spec: an AcceleratorSpec.
        dtype: "bf16"/"fp16"/"fp32" or a torch dtype. Default None: the best training dtype the
            device supports (bf16 if supported, else fp16). An unsupported dtype falls back in the
            order bf16, fp16, fp32.
    """
    if dtype is None:
        start = 0
    elif dtype in _DTYPE_KEYS:
        start = _DTYPE_FALLBACK.index(_DTYPE_KEYS[dtype])
    else:
        raise ValueError(f"unknown dtype {dtype!r}; use bf16, fp16, fp32 or a torch dtype")
    for key in _DTYPE_FALLBACK[start:]:
        rate = getattr(spec, f"{key}_tflops")
        if rate > 0:
            return rate
    raise ValueError(f"{spec.name} has no positive rate for {dtype!r} or any fallback dtype")


def normalize_scores(scores):
    """Scores scaled to fractions that sum to 1.0. Raises ValueError on an empty list or on a
    score that is not a positive finite number, naming its index."""
    scores = list(scores)
    if not scores:
        raise ValueError("normalize_scores: no scores given (need one per data-parallel rank)")
    for index, score in enumerate(scores):
        if not (isinstance(score, (int, float)) and math.isfinite(score) and score > 0):
            raise ValueError(f"normalize_scores: scores[{index}] = {score!r} must be a positive finite number")
    total = math.fsum(scores)
    return [score / total for score in scores]


@dataclass
class DeviceDescription:
    """One rank's device, as gathered across ranks (as plain dicts, see to_dict/from_dict)."""

    rank: int
    local_rank: int
    host: str
    name: str
    memory_bytes: int
    bf16: bool
    fp16: bool
    accelerator: str
    """The accelerator kind: 'cuda', 'cpu', 'xpu', ..."""
    spec_score: float
    """Prior speed in TFLOP/s, from the datasheet table or a short benchmark (see score_source)."""
    score_source: str
    """'spec' or 'measured'."""
    shared_host_memory: bool = False
    """memory_bytes is the host's RAM, which every rank on the host shares (DeepSpeed's CPU
    accelerator reports it as each device's memory): not a limit of this rank's own."""

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, values):
        expected = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing, unknown = required - set(values), set(values) - expected
        if missing or unknown:
            raise ValueError(f"DeviceDescription.from_dict: missing keys {sorted(missing)}, unknown keys "
                             f"{sorted(unknown)}")
        return cls(**values)


def _cpu_model_name():
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux
    try:
        import cpuinfo  # py-cpuinfo, a DeepSpeed requirement; portable but takes about a second
        return cpuinfo.get_cpu_info().get("brand_raw") or platform.processor() or "cpu"
    except ImportError:
        return platform.processor() or "cpu"


def _device_model_name(local_rank):
    accelerator = get_accelerator()
    if hasattr(accelerator, "get_device_name"):
        return accelerator.get_device_name(local_rank)
    kind = accelerator.device_name()
    if kind == "cpu":
        return _cpu_model_name()
    # DeepSpeed's accelerator interface has no model-name call; the torch device module that the
    # accelerator names (torch.cuda, torch.xpu, torch.npu, ...) has one.
    return torch.get_device_module(kind).get_device_name(local_rank)


def _current_device(local_rank):
    """A context in which device ``local_rank`` is the current one (the torch device module's own
    ``device`` context, e.g. ``torch.cuda.device``); a no-op where there is none (the CPU)."""
    kind = get_accelerator().device_name()
    module = getattr(torch, kind, None) if kind != "cpu" else None
    context = getattr(module, "device", None)
    available = getattr(module, "is_available", lambda: False)
    return context(local_rank) if callable(context) and available() else contextlib.nullcontext()


def _host_memory_bytes():
    try:
        import psutil
        return psutil.virtual_memory().total
    except ImportError:
        return None


def cpu_memory_capacity(reported_bytes, shared, cgroup_limit):
    """On the CPU accelerator, ``(bytes, shared)``: what a rank may plan for and whether the other
    ranks of its host share it.

    The accelerator reports the host's RAM (shared). A memory cgroup limit below it
    (``cgroup_files.memory_limit``: a job scheduler's per-task limit, a container's, one set by
    hand) is this process's own limit, and plans must fit it: it replaces the RAM and is not shared.
    Ranks that share one limited cgroup each plan for the whole of it; give each its own, or set
    ``emulation.memory_gb``.
    """
    if cgroup_limit is not None and cgroup_limit < reported_bytes:
        return int(cgroup_limit), False
    return int(reported_bytes), shared


def cgroup_memory_limit():
    """This process's memory cgroup limit in bytes, or None (no limit, not Linux, unreadable)."""
    from .cgroup_files import memory_limit
    try:
        return memory_limit()
    except (OSError, ValueError):
        return None  # not Linux, or an unreadable cgroup file: no limit known


def describe_local_device(local_rank=0, memory_bytes=None, rank=None, measure=True):
    """Describe this process's device, with a prior speed score.

    Name, capacity and score are those of device ``local_rank`` (on a host with several devices,
    each rank describes its own: see ``local_device_index``).

    Args:
        local_rank: index of the device on this host (default 0).
        memory_bytes: capacity to report instead of the real one, for emulated clusters. The
            real capacity still selects the datasheet variant. Default None: the real capacity
            (host RAM on the CPU accelerator).
        rank: global rank to record. Default None: $RANK, else local_rank.
        measure: benchmark a device the table does not know (default True). With False its
            score is 0.0 and its source "unknown": the caller will measure the real workload.
    """
    accelerator = get_accelerator()
    name = _device_model_name(local_rank)
    real_memory = accelerator.total_memory(local_rank)
    with _current_device(local_rank):
        # The accelerator answers these for its current device, which is not yet set when the
        # config is parsed (the engine sets it later).
        bf16 = bool(accelerator.is_bf16_supported())
        # The CPU accelerator's check returns None instead of False when mkldnn lacks fp16.
        fp16 = bool(accelerator.is_fp16_supported())
    spec = find_spec(name, real_memory)
    if spec is not None:
        score, source = spec_score(spec), "spec"
    elif not measure:
        score, source = 0.0, "unknown"
    else:
        score, source = measure_device_score(accelerator.device_name(local_rank)), "measured"
    shared = accelerator.device_name() == "cpu" and real_memory == _host_memory_bytes()
    if accelerator.device_name() == "cpu":
        real_memory, shared = cpu_memory_capacity(real_memory, shared, cgroup_memory_limit())
    return DeviceDescription(rank=int(os.environ.get("RANK", local_rank)) if rank is None else rank,
                             local_rank=local_rank,
                             host=socket.gethostname(),
                             name=name,
                             memory_bytes=int(real_memory if memory_bytes is None else memory_bytes),
                             bf16=bf16,
                             fp16=fp16,
                             accelerator=accelerator.device_name(),
                             spec_score=float(score),
                             score_source=source,
                             shared_host_memory=bool(shared))


def local_device_count():
    """Distinct devices on this host. The CPU accelerator counts NUMA nodes (or $LOCAL_SIZE) as
    devices, but they share one processor model and one RAM: one device."""
    accelerator = get_accelerator()
    return 1 if accelerator.device_name() == "cpu" else accelerator.device_count()


def local_device_index():
    """This process's device on its host: $LOCAL_RANK, as the engine picks its device, when that
    index exists here (a launcher that isolates devices leaves one visible), else the current one
    (device 0 on the CPU accelerator, whose "current device" is $LOCAL_RANK whatever the count).

    On a host with several accelerators rank k is thus described by device k's name and memory,
    not by device 0's (the accelerator's index-less calls answer for the current device, which is
    not yet set when the config is parsed)."""
    accelerator = get_accelerator()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is not None and 0 <= int(local_rank) < accelerator.device_count():
        return int(local_rank)
    if accelerator.device_name() == "cpu":
        return 0
    return int(accelerator.current_device())


def emulated_memory_bytes(emulation, rank):
    """Rank ``rank``'s emulated device memory in bytes, or None where the emulation gives none.

    Args:
        emulation: ``heterogeneous_config.emulation`` (an EmulationConfig) or None.
        rank: the data-parallel rank.
    """
    sizes = emulation.memory_gb if emulation is not None else None
    if not sizes or rank >= len(sizes):
        return None
    return int(sizes[rank] * BYTES_PER_GB)


def rank_memory_capacity(device_bytes, accelerator_name, ranks_on_host, cgroup_limit=None):
    """Memory one rank may use: a GPU's own memory; on the CPU accelerator the host's RAM, which
    every rank on the host shares (upstream gave each rank all of it), or this process's memory
    cgroup limit when it is below the RAM (``cpu_memory_capacity``: the rank's own, not shared).
    None when unknown.

    Args:
        device_bytes: the accelerator's total memory as it reports it (host RAM on CPU), or None.
        accelerator_name: ``get_accelerator().device_name()`` ('cuda', 'cpu', ...).
        ranks_on_host: processes on this host (at least 1 is assumed).
        cgroup_limit: this process's memory cgroup limit (``cgroup_memory_limit``), or None.
    """
    if device_bytes is None:
        return None
    if accelerator_name == "cpu":
        capacity, shared = cpu_memory_capacity(device_bytes, True, cgroup_limit)
        return int(capacity // max(1, int(ranks_on_host))) if shared else capacity
    return int(device_bytes)
