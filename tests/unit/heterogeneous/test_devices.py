# SPDX-License-Identifier: Apache-2.0
"""Device table lookups, score arithmetic and local device descriptions (no processes, no GPU)."""

import math
import sys

import pytest
import torch

from deepspeed.runtime.heterogeneous.measure import devices
from deepspeed.runtime.heterogeneous.measure.devices import (ACCELERATOR_SPECS, BYTES_PER_GB, DeviceDescription,
                                                             describe_local_device, find_spec, measure_device_score,
                                                             normalize_scores, spec_score)


@pytest.mark.parametrize("reported_name, expected", [
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB SXM"),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("Tesla V100-SXM2-16GB", "V100 SXM2 16GB"),
    ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"),
    ("Tesla V100-DGXS-32GB", "V100 SXM2 32GB"),
    ("Tesla V100-PCIE-16GB", "V100 PCIe 16GB"),
    ("Tesla V100-PCIE-32GB", "V100 PCIe 32GB"),
    ("Tesla V100S-PCIE-32GB", "V100S PCIe 32GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("AMD Instinct MI250X", "Instinct MI250X (one GCD)"),
    ("AMD Instinct MI250X/MI250", "Instinct MI250X (one GCD)"),
    ("AMD Instinct MI300X", "Instinct MI300X"),
    ("AMD Instinct MI300X VF", "Instinct MI300X"),
    ("nvidia h100 80gb hbm3", "H100 SXM"),
])
def test_find_spec_matches_names_reported_by_torch(reported_name, expected):
    assert find_spec(reported_name).name == expected


@pytest.mark.parametrize("reported_name", [
    "NVIDIA A10G",  # AWS's A10 variant has other clocks
    "NVIDIA L40",
    "NVIDIA GeForce RTX 3090 Ti",
    "NVIDIA GeForce RTX 4090 D",
    "NVIDIA RTX A6000",
    "NVIDIA GH200 480GB",
    "Tesla V100-FHHL-16GB",
    "AMD EPYC 7B13 64-Core Processor",
    "Intel(R) Xeon(R) Platinum 8480+",
    "NVIDIA",
    "",
])
def test_find_spec_unknown_devices_return_none(reported_name):
    assert find_spec(reported_name) is None


def test_find_spec_picks_memory_variant_from_capacity():
    # What torch reports as total_memory on the two A100 SXM4 parts.
    assert find_spec("NVIDIA A100", memory_bytes=85_899_345_920).name == "A100 80GB SXM"
    assert find_spec("NVIDIA A100", memory_bytes=42_505_273_344).name == "A100 40GB SXM"
    assert find_spec("Tesla V100", memory_bytes=34_089_730_048).name == "V100 SXM2 32GB"
    # The name wins over the capacity (an emulated or partitioned device reports less).
    assert find_spec("NVIDIA A100-SXM4-80GB", memory_bytes=10 * BYTES_PER_GB).name == "A100 80GB SXM"


def test_table_is_consistent():
    names = [spec.name for spec in ACCELERATOR_SPECS]
    assert len(names) == len(set(names))
    for spec in ACCELERATOR_SPECS:
        assert spec.fp16_tflops > spec.fp32_tflops > 0, spec.name
        assert spec.bf16_tflops >= 0 and spec.memory_gb > 0 and spec.bandwidth_gbps > 0, spec.name
    assert not find_spec("Tesla V100-SXM2-32GB").supports_bf16
    assert not find_spec("Tesla T4").supports_bf16
    assert find_spec("NVIDIA A100-SXM4-80GB").supports_bf16


def test_spec_score_uses_training_dtype_with_fallback():
    a100, v100 = find_spec("NVIDIA A100-SXM4-80GB"), find_spec("Tesla V100-SXM2-32GB")
    assert spec_score(a100) == 312.0
    assert spec_score(a100, "fp32") == 19.5
    assert spec_score(a100, torch.float32) == 19.5
    # No bf16 on a V100: training would run fp16.
    assert spec_score(v100) == 125.0
    assert spec_score(v100, torch.bfloat16) == 125.0
    assert spec_score(find_spec("NVIDIA H100 80GB HBM3")) > spec_score(a100) > spec_score(v100)
    with pytest.raises(ValueError, match="int8"):
        spec_score(a100, "int8")


def test_normalize_scores():
    assert normalize_scores([1.0, 3.0]) == pytest.approx([0.25, 0.75])
    fractions = normalize_scores([312.0, 125.0, 0.05])
    assert math.fsum(fractions) == pytest.approx(1.0)
    assert normalize_scores([7]) == [1.0]


@pytest.mark.parametrize("scores, message", [
    ([], "no scores"),
    ([1.0, 0.0], r"scores\[1\]"),
    ([-2.0, 1.0], r"scores\[0\]"),
    ([1.0, 1.0, float("nan")], r"scores\[2\]"),
    ([1.0, float("inf")], r"scores\[1\]"),
    ([1.0, "fast"], r"scores\[1\]"),
])
def test_normalize_scores_rejects_bad_input(scores, message):
    with pytest.raises(ValueError, match=message):
        normalize_scores(scores)


MATMUL_SLOWDOWN = 8
MATMUL_SECONDS, TRIAD_SECONDS = 0.01, 0.01  # per call, on the virtual clock below


class _VirtualClock:
    """The benchmark's clock, advanced only by the timed operations: the score then follows from
    the operations' costs alone, whatever else the machine runs."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def _expected_score(benchmark, matmul_seconds):
    """The score of a device whose 512 matmul takes `matmul_seconds` and whose triad takes
    TRIAD_SECONDS: the step model's harmonic combination of the two rates, in TFLOP/s."""
    size = benchmark._SMALL_MATMUL  # a matmul this slow leaves no room for the larger one
    matmul_tflops = 2 * size**3 / matmul_seconds / 1e12
    memory_tflops = 3 * 4 * benchmark._TRIAD_ELEMENTS / TRIAD_SECONDS / 1e9 * benchmark._STEP_FLOPS_PER_BYTE / 1e3
    return 1.0 / (1.0 / matmul_tflops + 1.0 / memory_tflops)


def test_measured_cpu_score_follows_the_matmul_speed_and_is_cached(monkeypatch):
    """The CPU has no datasheet entry, so its score is measured. On a clock that only the timed
    operations move, the score is the step model's combination of the matmul and triad rates, and
    matmuls 8 times as slow lower it by that model's amount: a score that ignored the measurement
    or timed the wrong thing would not move. A second call is served from the cache, without a
    single matmul."""
    benchmark = sys.modules[measure_device_score.__module__]
    clock = _VirtualClock()
    matmuls = []
    cost = {"matmul": MATMUL_SECONDS}

    def timed_mm(*args, **kwargs):
        matmuls.append(1)
        clock.now += cost["matmul"]
        return real_mm(*args, **kwargs)

    def timed_triad(a, b, c, scalar):
        clock.now += TRIAD_SECONDS
        return a

    real_mm = torch.mm
    monkeypatch.setattr(benchmark, "time", clock)
    monkeypatch.setattr(benchmark, "triad_", timed_triad)
    monkeypatch.setattr(benchmark, "_measured_scores", {})  # measure here, whatever ran before
    monkeypatch.setattr(torch, "mm", timed_mm)
    score = measure_device_score("cpu", seconds_budget=0.3)
    assert matmuls, "no matmul was timed"
    assert score == pytest.approx(_expected_score(benchmark, MATMUL_SECONDS), rel=1e-9)
    timed = len(matmuls)
    assert measure_device_score("cpu") == score and len(matmuls) == timed, "the cached score was measured again"

    monkeypatch.setattr(benchmark, "_measured_scores", {})
    cost["matmul"] = MATMUL_SLOWDOWN * MATMUL_SECONDS
    slowed = measure_device_score("cpu", seconds_budget=0.3)
    assert slowed == pytest.approx(_expected_score(benchmark, MATMUL_SLOWDOWN * MATMUL_SECONDS), rel=1e-9)
    assert slowed < score / 7, (slowed, score)  # matmuls dominate a CPU's score


def test_measured_cpu_score_is_a_real_measurement():
    """Unpatched, the measurement runs on the real clock: a finite, positive score, with the
    spread of its repeats."""
    benchmark = sys.modules[measure_device_score.__module__]
    measured = benchmark.measure_device_score_with_spread("cpu", seconds_budget=0.3)
    assert math.isfinite(measured.score) and measured.score > 0 and measured.repeats == benchmark._REPEATS


def test_device_description_round_trip():
    description = DeviceDescription(rank=3, local_rank=1, host="node-b", name="Tesla V100-SXM2-32GB",
                                    memory_bytes=34_089_730_048, bf16=False, fp16=True, accelerator="cuda",
                                    spec_score=125.0, score_source="spec")
    as_dict = description.to_dict()
    assert as_dict["name"] == "Tesla V100-SXM2-32GB" and as_dict["bf16"] is False
    assert DeviceDescription.from_dict(as_dict) == description
    with pytest.raises(ValueError, match="host"):
        DeviceDescription.from_dict({k: v for k, v in as_dict.items() if k != "host"})
    with pytest.raises(ValueError, match="speed"):
        DeviceDescription.from_dict({**as_dict, "speed": 1.0})


def test_describe_local_cpu_device():
    description = describe_local_device(rank=0)
    assert description.accelerator == "cpu"
    assert description.name and description.host
    assert description.memory_bytes > 0
    # The measured score itself (cached per device), not some other number.
    assert description.score_source == "measured" and description.spec_score == measure_device_score("cpu")

    emulated = describe_local_device(memory_bytes=8 * BYTES_PER_GB, rank=1)
    assert emulated.memory_bytes == 8 * BYTES_PER_GB and emulated.rank == 1


class _FakeGpuAccelerator:
    """Just the calls describe_local_device makes, answering like a CUDA accelerator would."""

    def __init__(self, name, memory_bytes):
        self.name, self.memory_bytes = name, memory_bytes

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def get_device_name(self, device_index):
        return self.name

    def total_memory(self, device_index=None):
        return self.memory_bytes

    def is_bf16_supported(self):
        return find_spec(self.name).supports_bf16

    def is_fp16_supported(self):
        return True


def test_describe_known_gpu_uses_the_table(monkeypatch):
    v100 = _FakeGpuAccelerator("Tesla V100-SXM2-32GB", 34_089_730_048)
    monkeypatch.setattr(devices, "get_accelerator", lambda: v100)
    monkeypatch.setenv("RANK", "5")
    description = describe_local_device(local_rank=1)
    assert (description.rank, description.local_rank, description.accelerator) == (5, 1, "cuda")
    assert (description.bf16, description.fp16) == (False, True)
    assert (description.spec_score, description.score_source) == (125.0, "spec")


def test_rank_memory_capacity_shares_host_ram_between_cpu_ranks():
    assert devices.rank_memory_capacity(64 * BYTES_PER_GB, "cpu", 4) == 16 * BYTES_PER_GB
    assert devices.rank_memory_capacity(80 * BYTES_PER_GB, "cuda", 8) == 80 * BYTES_PER_GB
    assert devices.rank_memory_capacity(None, "cpu", 2) is None
    # A memory cgroup below the RAM is this rank's own limit (one rule with the config-time devices).
    assert devices.rank_memory_capacity(64 * BYTES_PER_GB, "cpu", 4, 6 * BYTES_PER_GB) == 6 * BYTES_PER_GB
    assert devices.rank_memory_capacity(64 * BYTES_PER_GB, "cpu", 4, 128 * BYTES_PER_GB) == 16 * BYTES_PER_GB
    assert devices.rank_memory_capacity(80 * BYTES_PER_GB, "cuda", 8, 6 * BYTES_PER_GB) == 80 * BYTES_PER_GB


def test_emulated_memory_bytes_per_rank():
    from deepspeed.runtime.heterogeneous.config.settings import EmulationConfig
    emulation = EmulationConfig(memory_gb=[16, 0.5])
    assert [devices.emulated_memory_bytes(emulation, rank) for rank in range(3)] == [16 * BYTES_PER_GB, 2**29, None]
    assert devices.emulated_memory_bytes(EmulationConfig(speeds=[1.0]), 0) is None
    assert devices.emulated_memory_bytes(None, 0) is None


class _FakeTwoGpuHost(_FakeGpuAccelerator):

    def device_count(self):
        return 2

    def current_device(self):
        return 0


def test_local_device_follows_local_rank_where_the_index_exists(monkeypatch):
    host = _FakeTwoGpuHost("NVIDIA A100-SXM4-80GB", 80 * BYTES_PER_GB)
    monkeypatch.setattr(devices, "get_accelerator", lambda: host)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (devices.local_device_index(), devices.local_device_count()) == (1, 2)
    monkeypatch.setenv("LOCAL_RANK", "3")  # a launcher that isolates devices: the one visible device
    assert devices.local_device_index() == 0


def _two_device_cpu_host():
    """DeepSpeed's CPU accelerator reporting two devices with names and memory of their own."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class TwoDeviceHost(CPU_Accelerator):

        def device_count(self):
            return 2

        def get_device_name(self, device_index=None):
            return ["NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB"][int(device_index or 0)]

        def total_memory(self, device_index=None):
            return [80, 16][int(device_index or 0)] * BYTES_PER_GB

    return TwoDeviceHost()


def test_each_local_rank_describes_its_own_device(monkeypatch):
    """Rank k of a host describes device k: its name, its memory, its datasheet score (the CPU
    accelerator's index-less answers, and device 0's, are not rank 1's)."""
    host = _two_device_cpu_host()
    monkeypatch.setattr(devices, "get_accelerator", lambda: host)
    described = []
    for local_rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("RANK", local_rank)
        described.append(describe_local_device(local_rank=devices.local_device_index(), measure=False))
    assert [(d.local_rank, d.name, d.memory_bytes) for d in described] == [
        (0, "NVIDIA H100 80GB HBM3", 80 * BYTES_PER_GB), (1, "Tesla V100-SXM2-16GB", 16 * BYTES_PER_GB)]
    assert [d.spec_score for d in described] == [989.0, 125.0]
    # Memory of their own, not the host's RAM that the CPU accelerator reports: a limit per rank.
    assert not any(d.shared_host_memory for d in described)


def test_the_cpu_accelerator_reports_shared_host_memory(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert devices.local_device_index() == 1  # its "devices" are one processor: the same description
    description = describe_local_device(local_rank=devices.local_device_index(), measure=False)
    assert description.shared_host_memory and description.accelerator == "cpu"
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert devices.local_device_index() == 0
    # A description written without the key (before the field existed) reads as not shared.
    values = description.to_dict()
    del values["shared_host_memory"]
    assert DeviceDescription.from_dict(values).shared_host_memory is False
