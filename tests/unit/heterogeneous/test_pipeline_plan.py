# SPDX-License-Identifier: Apache-2.0
"""``plan_pipeline``: a pipeline of one stage per rank on a described cluster, its arithmetic checked
by hand (pure; one process, no process group)."""

import math

import pytest

from deepspeed.runtime.heterogeneous.forecast.cluster_file import parse_cluster
from deepspeed.runtime.heterogeneous.forecast.pipeline_plan import plan_pipeline


def two_stages(**training):
    def kind(name, tflops, cpu=False):
        return {"name": name, "fp32_tflops": tflops, "memory_gb": 16, "memory_bandwidth_gb_s": 32, "cpu": cpu}

    return parse_cluster({
        "hosts": [{"name": "a", "devices": [{"kind": kind("fast", 2.0)}]},
                  {"name": "b", "devices": [{"kind": kind("slow", 1.0)}]}],
        "inter_host_link": {"gbit_per_s": 8, "latency_us": 0},
        "model": {"parameters": 1_200_000, "layers": 12, "hidden": 1000, "seq_len": 1, "flops_per_sample": 1.2e9,
                  "activation_bytes_per_sample": 1.2e6, "largest_tensor": 100_000},
        "training": dict({"train_batch_size": 32, "gradient_accumulation_steps": 4, "precision": "fp32",
                          "efficiency": 1.0}, **training)})


def test_the_pipeline_of_a_case_checked_by_hand():
    plan = plan_pipeline(two_stages())
    # Layers of equal cost: twice the speed takes twice the layers.
    assert plan["stage_layers"] == [8, 4] and plan["parts"] == [0, 8, 12]
    fast, slow = plan["ranks"]
    # A micro-batch of 8 samples: 8 x 0.8e9 FLOPs at 2 TFLOP/s = 3.2 ms, 8 x 0.4e9 at 1 TFLOP/s = 3.2 ms.
    assert math.isclose(fast["compute_s_per_micro_batch"], 3.2e-3)
    assert math.isclose(slow["compute_s_per_micro_batch"], 3.2e-3)
    # 1F1B: both stages once, then 3 more micro-batches at the slowest stage's pace.
    assert math.isclose(plan["compute_s"], 2 * 3.2e-3 + 3 * 3.2e-3)
    # Boundary tensors of 8 x 1000 x 4 bytes, 2 x (4 + 2 - 2) of them at 1 GB/s.
    assert plan["bytes_per_boundary_per_step"] == 4 * 32_000
    assert math.isclose(plan["communication_s"], 8 * 32_000 / 1e9)
    # The optimizer step of the first stage's 800,000 parameters: 32 bytes each at 32 GB/s.
    assert math.isclose(plan["optimizer_s"], 800_000 * 32 / 32e9)
    assert math.isclose(plan["step_s"], plan["compute_s"] + plan["communication_s"] + plan["optimizer_s"])
    # Memory: 1F1B keeps 2 micro-batches in flight on the first stage, 1 on the last.
    assert fast["micro_batches_in_flight"] == 2 and slow["micro_batches_in_flight"] == 1
    assert math.isclose(fast["activation_bytes"], 2 * 8 * 8 * 0.1e6)
    # ZeRO-0 of 800,000 parameters on one data-parallel rank: in the backward its parameters, Adam's
    # state and the gradients (4 + 8 + 4 bytes each) beside the activations; the all-reduce buffer
    # (4 bytes each) comes after the activations are gone.
    assert fast["peak_phase"] == "backward" and fast["predicted_peak_bytes"] == 800_000 * 16 + 12.8e6
    assert plan["fits"] and plan["slowest_link"] == "inter-host"


def test_a_given_cut_and_what_cannot_be_planned():
    plan = plan_pipeline(two_stages(), stage_layers=[6, 6])
    assert plan["stage_layers"] == [6, 6] and plan["cut"] == "manual"
    # The slow stage now takes twice as long per micro-batch as the fast one: it sets the pace.
    fast, slow = plan["ranks"]
    assert math.isclose(slow["compute_s_per_micro_batch"], 2 * fast["compute_s_per_micro_batch"])
    assert plan["slowest_stage"] == 1
    with pytest.raises(ValueError, match="stage_layers"):
        plan_pipeline(two_stages(), stage_layers=[6, 5])
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        plan_pipeline(two_stages(gradient_accumulation_steps=None))
