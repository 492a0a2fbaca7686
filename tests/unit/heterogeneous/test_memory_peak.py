# SPDX-License-Identifier: Apache-2.0
"""The memory model's arithmetic (``memory/peak.py``), its use by the pool, the reaction to a measured
peak over budget (``planning/profiling.measured_peak_limit``) and the meter's sources. Pure: no processes.
Expected values are written out from the allocations each phase lists (docs/memory.md)."""

import pytest

from deepspeed.runtime.heterogeneous.memory.model_state import ActivationModel, RankCannotFitError
from deepspeed.runtime.heterogeneous.memory.meter import CGROUP, EMULATED, PROCESS, MemoryMeter
from deepspeed.runtime.heterogeneous.memory.peak import ZeroAllocations, predict_peak
from deepspeed.runtime.heterogeneous.memory.pool import HeterogeneousMemoryPool
from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec
from deepspeed.runtime.heterogeneous.planning.profiling import measured_peak_limit

MiB = 2**20
N = 1_000_000  # parameters; 4 MB in fp32
LARGEST = 100_000


def allocations(stage, **changes):
    settings = dict(num_parameters=N, largest_parameter=LARGEST, zero_stage=stage, world=2, param_bytes=4,
                    optimizer_bytes=8, optimizer_temporaries=2, reduce_bucket=500_000_000,
                    allgather_bucket=500_000_000, host_is_device=True)
    settings.update(changes)
    return ZeroAllocations(**settings)


def test_zero2_keeps_the_accumulated_partition_between_micro_steps():
    one, two = predict_peak(allocations(2), share=0.25), predict_peak(allocations(2, gradient_accumulation_steps=2),
                                                                      share=0.25)
    # At gas 2 the partition accumulated so far (0.25 * 4e6) lives through the next micro-step's
    # forward and backward, beside the partition that backward fills.
    for phase in ("forward", "backward", "reduce"):
        assert two.phase_bytes(phase) - one.phase_bytes(phase) == 1e6
    assert two.phase_bytes("step") == one.phase_bytes("step")
    # ZeRO-1 reduces only at the boundary, and offload accumulates into the fp32 partition's gradient.
    assert (predict_peak(allocations(1, gradient_accumulation_steps=2), share=0.25).phases["forward"]
            == predict_peak(allocations(1), share=0.25).phases["forward"])
    assert "accumulated gradients" not in {k for k, v in predict_peak(
        allocations(2, gradient_accumulation_steps=2), share=0.25, offloaded=0.5).phases["forward"].items() if v}


def test_zero2_phases_hold_the_buffers_upstream_allocates():
    peak = predict_peak(allocations(2), share=0.25, baseline_bytes=10 * MiB)
    # Kept: flat parameters 4e6, fp32 partition 0.25 * 4e6 = 1e6, Adam 0.25 * 8e6 = 2e6.
    assert peak.phase_bytes("forward") == 10 * MiB + 4e6 + 1e6 + 2e6
    # Backward: + gradient partition 1e6, one gradient in flight 4e5; the reduce, once the bucket
    # (the whole model, under reduce_bucket_size: 4e6) is full: + the bucket and the largest
    # owner's slice flattened (0.5 of the bucket: 2e6).
    assert peak.phase_bytes("backward") == 10 * MiB + 7e6 + 1e6 + 4e5
    assert peak.phase_bytes("reduce") == 10 * MiB + 7e6 + 1e6 + 4e5 + 4e6 + 2e6
    # Step: kept + gradient partition 1e6 + fp32 gradient partition 1e6 + Adam's two temporaries of
    # the stepped partition 2 * 1e6.
    assert peak.phase_bytes("step") == 10 * MiB + 7e6 + 1e6 + 1e6 + 2e6
    # All-gather on a host backend: the gathered output staged, 4e6.
    assert peak.phase_bytes("all-gather") == 10 * MiB + 7e6 + 1e6 + 4e6
    assert peak.peak_phase == "reduce" and peak.peak_bytes == int(10 * MiB + 14.4e6)
    assert peak.buffer_bytes == pytest.approx(4e5 + 4e6 + 2e6)
    # Uneven shares: each owner broadcasts its slice into the flat parameters in place, nothing staged.
    uneven = predict_peak(allocations(2), share=0.25, baseline_bytes=10 * MiB, largest_share=0.75)
    assert uneven.phase_bytes("all-gather") == 10 * MiB + 7e6 + 1e6


def test_the_overlap_worker_holds_its_buckets_twice_during_the_backward():
    """With communication.overlap in force, up to DEPTH (3) buckets are set aside with their gradients
    and each is copied for the worker to reduce: 2 x 3 buckets, never more than twice the gradients."""
    plain = predict_peak(allocations(2, reduce_bucket=100_000), share=0.5)
    worker = predict_peak(allocations(2, reduce_bucket=100_000, overlap_buckets=3), share=0.5)
    assert worker.phases["backward"]["overlap buckets"] == 2 * 3 * 100_000 * 4
    assert worker.phase_bytes("backward") == plain.phase_bytes("backward") + 2.4e6
    assert worker.phase_bytes("step") == plain.phase_bytes("step")  # drained before the step
    # A bucket as large as the model: at most the whole gradients, twice.
    whole = predict_peak(allocations(2, overlap_buckets=3), share=0.5)
    assert whole.phases["backward"]["overlap buckets"] == 2 * N * 4
    # ZeRO-3 too, padded like its buckets; nothing where ZeRO-1/2 cannot overlap (no contiguous gradients).
    zero3 = predict_peak(allocations(3, reduce_bucket=100_000, overlap_buckets=3), share=0.25, largest_share=0.75)
    assert zero3.phases["backward"]["overlap buckets"] == 2 * 3 * 100_000 * 4 * 1.5
    scattered = predict_peak(allocations(2, overlap_buckets=3, contiguous_gradients=False), share=0.5)
    assert "overlap buckets" not in scattered.phases["backward"]


def test_overlap_buckets_are_planned_where_overlap_may_apply():
    from types import SimpleNamespace
    from deepspeed.runtime.heterogeneous.comm.overlap import expected
    from deepspeed.runtime.heterogeneous.config.blocks import CommunicationConfig
    zero = SimpleNamespace(stage=2, offload_optimizer=None, reduce_scatter=True)
    assert expected(CommunicationConfig(), zero, [0, 0, 1, 1])
    assert not expected(CommunicationConfig(), zero, [0, 0, 0, 0])  # one host: no hierarchical reduction
    assert not expected(CommunicationConfig(overlap=False), zero, [0, 0, 1, 1])
    assert not expected(CommunicationConfig(), SimpleNamespace(stage=2, offload_optimizer=SimpleNamespace(device="cpu"),
                                                               reduce_scatter=True), [0, 0, 1, 1])


def test_zero1_holds_every_gradient_until_the_boundary():
    # A small bucket (4e5 bytes): the whole gradients (4e6) are there when the reduce starts and
    # leave one by one as the bucket takes them: 4e6 in all, not 4e6 + 4e5.
    small = predict_peak(allocations(1, reduce_bucket=100_000), share=0.5)
    kept = 4e6 + 2e6 + 4e6
    assert small.phase_bytes("reduce") == kept + 2e6 + 4e5 + 4e6 + 2e5
    # A bucket as large as the model holds them all: the same bytes.
    whole = predict_peak(allocations(1), share=0.5)
    assert whole.phase_bytes("reduce") == kept + 2e6 + 4e5 + 4e6 + 2e6


def test_zero0_under_bf16_converts_the_module_and_steps_fp32_copies():
    peak = predict_peak(allocations(0, param_bytes=2, master_bytes=4, converted=True))
    # Converted parameters 2e6, fp32 master 4e6, Adam 8e6; step: + bf16 gradients 2e6, fp32
    # gradient copies 4e6, temporaries of the largest tensor 8e5.
    assert peak.phase_bytes("initialize") == 6e6
    assert peak.phase_bytes("step") == 6e6 + 8e6 + 2e6 + 4e6 + 8e5


def test_buckets_and_the_device_change_what_is_held():
    small = predict_peak(allocations(2, reduce_bucket=100_000, allgather_bucket=100_000), share=0.5,
                         activation_bytes=1e6)
    # Bucket 4e5, slice 0.5 * 4e5, reduced while the activations (1e6) live; kept 4e6 + 2e6 + 4e6,
    # gradient partition 2e6, in flight 4e5.
    assert small.phase_bytes("backward") == 4e6 + 2e6 + 4e6 + 1e6 + 2e6 + 4e5 + 4e5 + 2e5
    on_device = predict_peak(allocations(2, host_is_device=False), share=0.5)
    assert on_device.phase_bytes("all-gather") == 4e6 + 2e6 + 4e6 + 2e6  # NCCL gathers in place
    overlap = predict_peak(allocations(2, overlap_comm=True), share=0.5)
    assert overlap.phase_bytes("reduce") - predict_peak(allocations(2), share=0.5).phase_bytes("reduce") == 4e6


def test_zero0_sgd_and_offload():
    sgd = predict_peak(allocations(0, optimizer_bytes=0, optimizer_temporaries=0), activation_bytes=1e6)
    # Parameters are resident (in the baseline); gradients 4e6 beside the activations 1e6, then
    # beside the all-reduce buffer 4e6 once autograd has freed the activations.
    assert sgd.phase_bytes("backward") == 5e6 and sgd.peak_bytes == 8e6 and sgd.peak_phase == "reduce"
    adam = predict_peak(allocations(0))
    # + Adam's state 8e6; the step's temporaries are of the largest tensor only (host loop): 8e5.
    assert adam.phase_bytes("reduce") == 16e6 and adam.phase_bytes("step") == 8e6 + 4e6 + 8e5
    # Offloaded to a host that is not the device: the fp32 partition and Adam's state leave it,
    # two gradient buffers of the largest parameter come.
    gpu = predict_peak(allocations(2, host_is_device=False), share=0.5, offloaded=1.0)
    assert gpu.phase_bytes("forward") == 4e6 + 2 * 4e5
    # On the CPU accelerator the host is the device: nothing leaves, the offload buffers add.
    cpu = predict_peak(allocations(2), share=0.5, offloaded=1.0)
    assert cpu.phase_bytes("forward") == 4e6 + 2e6 + 4e6 + 2e6 + 2e6 + 2 * 4e5


def test_zero3_gathers_whole_parameters_and_steps_sub_groups():
    peak = predict_peak(allocations(3, sub_group_size=200_000))
    # Partition 2e6, fp32 partition 2e6, Adam 4e6; gathered 4e6 beside the prefetch bucket's flat
    # tensor they were copied from (the whole model: 4e6); fp32 gradient partition 2e6; bucket 4e6.
    assert peak.phase_bytes("backward") == 2e6 + 2e6 + 4e6 + 4e6 + 4e6 + 2e6 + 4e6
    # Step: the sub-group's gradient flattened (2e5 elements: 8e5) and Adam's temporaries of it: 2 * 8e5.
    assert peak.phase_bytes("step") == 8e6 + 2e6 + 8e5 + 2 * 8e5
    # Upstream keeps every parameter used again within stage3_max_reuse_distance gathered (1e9: all),
    # and a prefetch bucket's flat tensor (5e4 elements: 2e5) lives beside them.
    limited = predict_peak(allocations(3, max_live_parameters=100_000, prefetch_bucket=50_000))
    assert limited.phase_bytes("forward") == 8e6 + 4e6 + 2e5
    limited = predict_peak(allocations(3, max_live_parameters=100_000, prefetch_bucket=50_000,
                                       max_reuse_distance=10_000))
    assert limited.phase_bytes("forward") == 8e6 + 4e5 + 2e5
    # One reduce bucket on the host under overlap_comm (only the pages its gradients fill are
    # touched); on a device the doubled count stays.
    assert predict_peak(allocations(3, overlap_comm=True)).phases["backward"]["reduce bucket"] == 4e6
    assert predict_peak(allocations(3, overlap_comm=True, host_is_device=False)).phases["backward"][
        "reduce bucket"] == 8e6


def test_zero3_offload_keeps_an_fp32_gradient_buffer_per_offloaded_sub_group_on_the_host():
    """Upstream's ZeRO-3 optimizer offload zeroes an fp32 gradient buffer for each offloaded
    sub-group at start-up, beside the gradient partition: on the CPU accelerator (the host is the
    device) it is the rank's memory, on a GPU it is host memory."""
    cpu = predict_peak(allocations(3), share=0.5, offloaded=1.0)
    assert cpu.phases["initialize"] == predict_peak(allocations(3), share=0.5).phases["initialize"]
    for phase in ("forward", "backward", "step"):
        assert cpu.phases[phase]["offloaded fp32 gradients"] == 0.5 * 4e6
    assert predict_peak(allocations(3), share=0.5, offloaded=0.25).phases["forward"]["offloaded fp32 gradients"] == 5e5
    gpu = predict_peak(allocations(3, host_is_device=False), share=0.5, offloaded=1.0)
    assert "offloaded fp32 gradients" not in gpu.phases["backward"]


def test_frozen_parameters_are_gathered_and_moved_but_keep_no_state():
    """A LoRA model: 1e6 trained parameters (the adapters) on a base of 9e6 frozen ones. ZeRO-3
    gathers the frozen ones too (whole, beside the bucket's flat tensor); they have no gradient or
    optimizer state, and where the module is moved to the device or converted they move too."""
    lora = predict_peak(allocations(3, frozen_parameters=9_000_000), share=0.5)
    plain = predict_peak(allocations(3), share=0.5)
    assert lora.phases["forward"]["gathered parameters"] == 2 * 4e7
    for phase in ("forward", "backward"):
        kept = {k: v for k, v in lora.phases[phase].items() if k != "gathered parameters"}
        assert kept == {k: v for k, v in plain.phases[phase].items() if k != "gathered parameters"}
    moved = predict_peak(allocations(2, frozen_parameters=9_000_000, parameters_resident=False), share=0.5)
    assert moved.phases["forward"]["parameters"] == 4e6 + 4e7  # the flat trained parameters + the module moved
    converted = predict_peak(allocations(0, frozen_parameters=9_000_000, param_bytes=2, master_bytes=4,
                                         converted=True))
    assert converted.phases["initialize"]["parameters"] == 2e7  # every parameter converted to 2 bytes
    with pytest.raises(ValueError, match="frozen_parameters -1"):
        allocations(3, frozen_parameters=-1)


def test_a_zero3_share_scales_what_the_rank_keeps_and_uneven_buckets_are_padded():
    """Share 0.2 of 1e6 fp32 parameters with the largest rank at 0.8: the partition, fp32 copy,
    Adam state and gradient partition are 0.2 of the whole; a gathered or reduced bucket is padded
    to the largest slice on each of the 2 ranks (1.6 buckets)."""
    even = predict_peak(allocations(3, max_live_parameters=100_000, prefetch_bucket=50_000,
                                    max_reuse_distance=10_000, reduce_bucket=100_000))
    small = predict_peak(allocations(3, max_live_parameters=100_000, prefetch_bucket=50_000,
                                     max_reuse_distance=10_000, reduce_bucket=100_000), share=0.2, largest_share=0.8)
    kept = {"parameters": 4e6, "fp32 partition": 4e6, "optimizer state": 8e6}
    for name, whole in kept.items():
        assert even.phases["forward"][name] == whole / 2 and small.phases["forward"][name] == pytest.approx(whole * 0.2)
    assert small.phases["backward"]["gradient partition"] == pytest.approx(4e6 * 0.2)
    assert small.phases["backward"]["reduce bucket"] == pytest.approx(4e5 * 1.6)
    assert small.phases["forward"]["gathered parameters"] == pytest.approx((100_000 + 50_000 * 1.6) * 4)


def test_bad_allocations_are_refused():
    with pytest.raises(ValueError, match="zero_stage 4"):
        allocations(4)
    with pytest.raises(ValueError, match="world 0"):
        allocations(2, world=0)


def test_the_pool_fits_the_predicted_peak_with_each_ranks_baseline():
    spec = ModelStateSpec(num_parameters=N, zero_stage=2, allocations=allocations(2))
    pool = HeterogeneousMemoryPool([100 * MiB, 100 * MiB], hbm_utilization_threshold=1.0)
    placement = pool.place(spec, zero_partitions="even", baseline_bytes=[0, 90 * MiB], strict=False,
                           cpu_offload=False)
    first, second = placement.ranks
    assert second.baseline_bytes == 90 * MiB
    assert second.predicted_peak_bytes == first.predicted_peak_bytes + 90 * MiB
    assert first.fits and not second.fits
    assert "in use at the engine's start" in placement.problems[0]
    # "auto" gives the rank with the larger baseline the smaller share, and it fits.
    auto = pool.place(spec, zero_partitions="auto", baseline_bytes=[0, 80 * MiB])
    # On the CPU accelerator the host is the device: offloading would only add buffers, so the
    # pool does not offload there.
    assert not pool.place(spec, zero_partitions="even", baseline_bytes=[0, 90 * MiB], strict=False).offloaded_ranks
    auto = pool.place(spec, zero_partitions="auto", baseline_bytes=[0, 80 * MiB])
    assert auto.partition_shares[1] < 0.5 and all(r.fits for r in auto.ranks)
    report = pool.report().to_dict()["ranks"][1]
    assert report["predicted_peak_bytes"] == auto.ranks[1].predicted_peak_bytes
    assert report["measured_peak_bytes"] is None
    pool.record_measured_peaks([None, 95 * MiB])
    assert pool.report().to_dict()["ranks"][1]["measured_peak_bytes"] == 95 * MiB
    assert "measured peak" in str(pool.report())
    backward = pool.predicted_peak(0).phase_bytes("backward")
    pool.record_activations(0, 30 * MiB)  # the forward and backward phases hold them
    assert pool.placement.ranks[0].activation_bytes == 30 * MiB
    assert pool.placement.ranks[0].predicted_peak_bytes == int(backward + 30 * MiB)
    assert pool.placement.ranks[0].peak_phase == "backward"


def _history(peak, ran=8):
    return [[{"samples": [(ran, 0.1, 1000)], "capacity_peak_bytes": peak}]]


def test_a_measured_peak_over_budget_takes_samples_away():
    per_sample = ActivationModel(base=0.0, per_sample=10 * MiB)
    # Budget 80% of 1000 MiB = 800 MiB; measured 835 MiB at 8 samples: 3.5 samples over -> 4 fewer.
    assert measured_peak_limit(_history(835 * MiB), 0, 1000 * MiB, per_sample, 0.8, "rank 0") == 4
    assert measured_peak_limit(_history(790 * MiB), 0, 1000 * MiB, per_sample, 0.8, "rank 0") == float("inf")
    assert measured_peak_limit(_history(None), 0, 1000 * MiB, per_sample, 0.8, "rank 0") == float("inf")
    # Over budget by more than its samples take, within its capacity: it keeps what it ran.
    assert measured_peak_limit(_history(900 * MiB), 0, 1000 * MiB, per_sample, 0.8, "rank 0") == 8
    with pytest.raises(RankCannotFitError, match=r"rank 0 measured a memory peak of 0\.9863 GiB at 8 sample.*"
                       r"beyond its capacity 0\.9766 GiB"):
        measured_peak_limit(_history(1010 * MiB), 0, 1000 * MiB, per_sample, 0.8, "rank 0")


def test_the_meter_reads_the_source_that_limits_the_rank(tmp_path):
    class Cpu:
        def device_name(self):
            return "cpu"

    (tmp_path / "memory.usage_in_bytes").write_text("1234\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text("5678\n")
    meter = MemoryMeter(Cpu(), cgroup_dir=tmp_path)
    assert meter.source == CGROUP and meter.start() == 1234 and meter.peak_bytes() == 5678
    emulated = MemoryMeter(Cpu(), cgroup_dir=tmp_path, source=EMULATED)
    assert emulated.start() == 0 and emulated.peak_bytes() is None
    process = MemoryMeter(Cpu(), source=PROCESS)
    assert process.current_bytes() > 0 and process.peak_bytes() >= process.current_bytes()
