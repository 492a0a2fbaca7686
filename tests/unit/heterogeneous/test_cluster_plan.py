# SPDX-License-Identifier: Apache-2.0
"""``deepspeed plan`` on described clusters: the cluster and model descriptions, the device table,
the plan's arithmetic on a case checked by hand, and every example cluster planned (pure; one
process, no process group)."""

import json
import math
import sys
from pathlib import Path

import pytest

from deepspeed.runtime.heterogeneous.cli.plan import main as plan_main
from deepspeed.runtime.heterogeneous.forecast.cluster_file import (ClusterDescriptionError, load_cluster_file,
                                                                   parse_cluster)
from deepspeed.runtime.heterogeneous.forecast.cluster_plan import plan_cluster
from deepspeed.runtime.heterogeneous.forecast.comm_model import zero_collectives
from deepspeed.runtime.heterogeneous.forecast.model_description import (describe_model, hf_config_model,
                                                                        repo_model)
from deepspeed.runtime.heterogeneous.measure.device_table import (ACCELERATOR_SPECS, DATASHEETS, DEVICE_KINDS,
                                                                  find_kind)
from deepspeed.runtime.heterogeneous.measure.devices import find_spec

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples" / "clusters").glob("cluster*"))


def two_hosts(**changes):
    data = {"hosts": [{"name": "a", "devices": [{"kind": "A100-80GB", "count": 2}]},
                      {"name": "b", "count": 2, "devices": [{"kind": "rtx-3090"}]}],
            "inter_host_link": {"gbit_per_s": 25, "latency_us": 20}}
    data.update(changes)
    return data


# -- the cluster description ---------------------------------------------------------------------


def test_ranks_are_numbered_host_by_host():
    cluster = parse_cluster(two_hosts())
    assert cluster.world_size == 4
    assert [r.spec.kind for r in cluster.ranks] == ["A100-80GB", "A100-80GB", "RTX-3090", "RTX-3090"]
    assert cluster.host_names == ("a", "b-0", "b-1") and cluster.hosts == [0, 0, 1, 2]
    assert cluster.ranks[0].memory_bytes == 80 * 2**30
    assert cluster.intra_host_links[0].assumed and not cluster.inter_host_link.assumed
    assert cluster.inter_host_link.bytes_per_s == 25e9 / 8


@pytest.mark.parametrize("change, words", [
    (dict(hosts=[{"name": "a", "devices": [{"kind": "A100-80GB"}], "gpus": 4}]), ["hosts[0]", "'gpus'", "allowed"]),
    (dict(hosts=[{"devices": [{"kind": "A100"}]}]), ["hosts[0].devices[0].kind", "'A100'", "A100-80GB", "numbers"]),
    (dict(hosts=[{"devices": [{"kind": "T4", "count": 0}]}]), ["devices[0].count", ">= 1"]),
    (dict(inter_host_link=None), ["inter_host_link is required with 3 hosts"]),
    (dict(inter_host_link={"gbit_per_s": -1}), ["inter_host_link.gbit_per_s", "positive"]),
    (dict(training={"precision": "fp8"}), ["training.precision", "bf16"]),
    (dict(training={"zero_stage": 4}), ["training.zero_stage", "auto"]),
    (dict(hosts=[{"devices": [{"kind": "EPYC-7763-core"}]}]), ["memory_gb is required", "EPYC-7763-core"]),
    (dict(hosts=[{"devices": [{"kind": {"name": "x", "fp32_tflops": 1}}]}]), ["kind", "missing", "memory_gb"]),
])
def test_bad_descriptions_name_the_key_and_what_is_allowed(change, words):
    data = two_hosts(**change)
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ClusterDescriptionError) as error:
        parse_cluster(data)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_a_kind_given_by_numbers(tmp_path):
    kind = {"name": "my-card", "bf16_tflops": 100, "fp32_tflops": 20, "memory_gb": 32, "memory_bandwidth_gb_s": 900}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hosts": [{"devices": [{"kind": kind, "count": 2}]}]}))
    cluster = load_cluster_file(str(path))
    assert not cluster.ranks[0].from_table and cluster.ranks[0].spec.bf16_tflops == 100
    assert cluster.ranks[1].memory_bytes == 32 * 2**30


def test_yaml_and_broken_files(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text("hosts:\n  - devices: [{kind: L4, count: 3}]\n")
    assert load_cluster_file(str(path)).world_size == 3
    broken = tmp_path / "c.json"
    broken.write_text("{\"hosts\": [")
    with pytest.raises(ClusterDescriptionError, match="not valid JSON"):
        load_cluster_file(str(broken))


# -- the device table ----------------------------------------------------------------------------


def test_the_table_holds_the_kinds_asked_for_each_with_its_datasheet():
    for kind in ("H100", "A100-80GB", "A100-40GB", "L40S", "A10", "V100-32GB", "V100-16GB", "RTX-4090", "RTX-3090",
                 "T4", "L4", "MI250X", "EPYC-7763-core"):
        spec = find_kind(kind.lower())
        assert spec is not None, kind
        document, url = DATASHEETS[spec.source]
        assert document and url.startswith("https://"), kind
    assert len({spec.kind for spec in DEVICE_KINDS}) == len(DEVICE_KINDS)
    # Dense rates: the H100 SXM's 1,979 TFLOP/s is printed with sparsity.
    assert find_kind("H100").bf16_tflops == 989.0 and find_kind("L4").fp16_tflops == 121.0
    assert find_kind("V100-16GB").bf16_tflops == 0  # no bf16 arithmetic


def test_a_running_cpu_rank_is_still_measured_not_looked_up():
    assert find_spec("AMD EPYC 7763 64-Core Processor") is None
    assert find_spec("NVIDIA A100-SXM4-80GB") in ACCELERATOR_SPECS


# -- the model description -----------------------------------------------------------------------


def test_a_hugging_face_config_on_the_meta_device(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    values = {"model_type": "gpt2", "n_layer": 5, "n_embd": 32, "n_head": 4, "vocab_size": 100, "n_positions": 64}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    counted = hf_config_model(str(path), cache_dir=str(tmp_path / "cache"))
    config = transformers.AutoConfig.for_model(**values)
    with torch.device("meta"):
        real = transformers.AutoModelForCausalLM.from_config(config)
    assert counted.num_parameters == sum(p.numel() for p in real.parameters())
    assert counted.largest_tensor == max(p.numel() for p in real.parameters())
    assert (counted.layers, counted.hidden, counted.seq_len) == (5, 32, 64)
    assert hf_config_model(str(path), cache_dir=str(tmp_path / "cache")) == counted  # read back from the cache
    deeper = counted.with_layers(7)
    assert deeper.num_parameters - counted.num_parameters == 2 * counted.per_layer_parameters


def test_the_repository_models_count_as_they_build():
    sys.path.insert(0, str(REPO))
    from examples.tiny_gpt import GPT, GPTConfig
    for name, config in (("tiny_gpt", GPTConfig.bench()), ("tiny_gpt.demo", GPTConfig.demo())):
        assert repo_model(name).num_parameters == sum(p.numel() for p in GPT(config).parameters())


def test_models_by_numbers():
    model = describe_model({"parameters": 1000, "layers": 10, "hidden": 8, "seq_len": 4})
    assert model.num_parameters == 1000 and model.with_layers(20).num_parameters == 2000
    assert model.flops_per_sample() == 4 * (6 * 1000 + 6 * 10 * 4 * 8)
    with pytest.raises(ValueError, match="allowed"):
        describe_model({"parameters": 10, "size": 3})
    with pytest.raises(ValueError, match="tiny_gpt"):
        describe_model("no-such-model")


# -- the plan's arithmetic, by hand ----------------------------------------------------------------


def hand_cluster():
    def kind(name, tflops):
        return {"name": name, "fp32_tflops": tflops, "memory_gb": 16, "memory_bandwidth_gb_s": 32}

    return parse_cluster({
        "hosts": [{"devices": [{"kind": kind("fast", 2.0)}, {"kind": kind("slow", 1.0)}],
                   "intra_host_link": {"gbit_per_s": 8, "latency_us": 0}}],
        "model": {"parameters": 1_000_000, "flops_per_sample": 1e9, "activation_bytes_per_sample": 1e6},
        "training": {"train_batch_size": 6, "gradient_accumulation_steps": 1, "precision": "fp32", "zero_stage": 0,
                     "efficiency": 1.0}})


def test_the_plan_of_a_case_checked_by_hand():
    result = plan_cluster(hand_cluster(), largest=False)
    fork, upstream = result["fork"], result["upstream"]
    # 2000 and 1000 samples/s: the fork gives 4 and 2 samples (2 ms each), upstream 3 and 3 (3 ms).
    assert [r["micro_batch"] for r in fork["ranks"]] == [4, 2]
    assert [r["micro_batch"] for r in upstream["ranks"]] == [3, 3]
    assert math.isclose(fork["compute_s"], 2e-3) and math.isclose(upstream["compute_s"], 3e-3)
    # ZeRO-0: one ring all-reduce of 4 MB gradients over 2 ranks: each sends 2 * 1/2 * 4 MB = 4 MB at 1 GB/s.
    assert fork["bytes_per_rank_per_step"] == 4_000_000 and math.isclose(fork["communication_s"], 4e-3)
    # Adam's step reads and writes parameters, gradients and 8 bytes of state: 16 B x 2 per element at 32 GB/s.
    assert math.isclose(fork["optimizer_s"], 1e-3)
    # ZeRO-0 memory of the fast rank: its parameters (4 MB: a plan has no baseline that holds them), Adam's
    # 8 MB, 4 samples of 1 MB activations, then the gradients (4 MB) and their all-reduce buffer (4 MB).
    assert fork["ranks"][0]["peak_by_phase"] == {"initialize": 4e6, "forward": 16e6, "backward": 20e6,
                                                 "reduce": 20e6, "step": 16e6}
    assert math.isclose(fork["step_s"], 7e-3) and math.isclose(upstream["step_s"], 8e-3)
    assert math.isclose(result["speedup"], 8 / 7)
    assert fork["fits"] and upstream["fits"]
    assert result["ds_config"]["heterogeneous_config"]["enabled"]
    assert result["ds_config"]["gradient_accumulation_steps"] == 1


def test_collectives_pad_to_the_largest_share():
    link = parse_cluster(two_hosts()).inter_host_link
    even = zero_collectives(3, 1000, 2, 4, 2, 0.25, link)
    uneven = zero_collectives(3, 1000, 2, 4, 2, 0.5, link)
    assert [c.per_step for c in even] == [2, 2]
    assert even[0].bytes_per_rank == 3 * 0.25 * 2000 and uneven[0].bytes_per_rank == 3 * 0.5 * 2000
    assert zero_collectives(2, 1000, 2, 1, 1, 1.0, link) == []


def test_collectives_as_deepspeed_runs_them():
    link = parse_cluster(two_hosts()).inter_host_link
    ring = 3 * 0.25 * 2000  # one ring pass over 4 ranks of a 2000-byte tensor

    def sent(*args, **kwargs):
        return [(c.per_step, c.bytes_per_rank) for c in zero_collectives(*args, **kwargs)]

    # ZeRO-1/2 all-reduce each gradient bucket (use_multi_rank_bucket_allreduce), ZeRO-2 at every micro-step.
    assert sent(1, 1000, 2, 4, 3, 0.25, link) == [(1, 2 * ring), (1, ring)]
    assert sent(2, 1000, 2, 4, 3, 0.25, link) == [(3, 2 * ring), (1, ring)]
    assert sent(2, 1000, 2, 4, 3, 0.25, link, gradient_all_reduce=False) == [(3, ring), (1, ring)]
    # ZeRO-3: the backward gathers only what the forward released beyond stage3_max_reuse_distance.
    assert sent(3, 1000, 2, 4, 2, 0.25, link) == [(2, ring), (2, ring)]
    assert sent(3, 1000, 2, 4, 2, 0.25, link, max_reuse_distance=400) == [(2, ring), (2, 0.6 * ring), (2, ring)]
    # gloo runs a reduce-scatter as an all-reduce of the whole tensor.
    assert sent(3, 1000, 2, 4, 2, 0.25, link, backend="gloo") == [(2, ring), (2, 2 * ring)]
    with pytest.raises(ValueError, match="nccl"):
        zero_collectives(3, 1000, 2, 4, 2, 0.25, link, backend="mpi")


def test_cpu_ranks_plan_gloo_and_host_memory():
    kind = {"name": "core", "fp32_tflops": 0.05, "memory_gb": 4, "memory_bandwidth_gb_s": 10}
    question = {"model": {"parameters": 1_000_000, "flops_per_sample": 1e9, "activation_bytes_per_sample": 1e6},
                "training": {"train_batch_size": 4, "gradient_accumulation_steps": 1, "precision": "fp32",
                             "zero_stage": 3, "efficiency": 1.0}}
    plans = {}
    for cpu in (False, True):
        cluster = parse_cluster({"hosts": [{"devices": [{"kind": dict(kind, cpu=cpu), "count": 2}]}], **question})
        assert [r.cpu for r in cluster.ranks] == [cpu, cpu]
        plans[cpu] = plan_cluster(cluster, largest=False)["fork"]
    # gloo runs the reduce-scatter as an all-reduce: one more ring pass of the 4 MB gradients, 2 MB.
    assert plans[True]["bytes_per_rank_per_step"] - plans[False]["bytes_per_rank_per_step"] == 2_000_000
    assert parse_cluster({"hosts": [{"devices": [{"kind": "EPYC-7763-core", "memory_gb": 2}]}]}).ranks[0].cpu
    with pytest.raises(ClusterDescriptionError, match="cpu"):
        parse_cluster({"hosts": [{"devices": [{"kind": dict(kind, cpu="yes")}]}]})


def test_the_largest_model_is_larger_where_memory_differs():
    result = plan_cluster(parse_cluster({
        "hosts": [{"devices": [{"kind": "A100-80GB"}, {"kind": "T4"}], "memory_gb": 256}],
        "model": {"parameters": 100_000_000, "layers": 10, "hidden": 1024, "vocab": 1000, "seq_len": 256},
        "training": {"train_batch_size": 8, "zero_stage": 3}}))
    largest = result["largest_model"]
    assert largest["fork"]["parameters"] > largest["upstream"]["parameters"] > 0


# -- the example clusters ------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_cluster_plans(path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DS_HETERO_PLAN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    assert plan_main(["--cluster", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "upstream (even split)" in text and "Priors" in text
    result = json.loads(out.read_text())
    assert result["fork"]["fits"], result["fork"]["problems"]
    assert result["ds_config"]["heterogeneous_config"]["enabled"]


def test_examples_ask_the_questions_of_the_issue():
    names = " ".join(p.name for p in EXAMPLES)
    for part in ("a100x4_rtx3090x8", "h100x64_a100x64", "single_host", "cpu_2ranks"):
        assert part in names
    assert load_cluster_file(str(REPO / "examples/clusters/cluster_h100x64_a100x64_16hosts.json")).world_size == 128


def test_a_bad_file_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"hosts": [{"devices": [{"kind": "B200"}]}]}))
    assert plan_main(["--cluster", str(path)]) == 2
    assert "'B200' is not a known device kind" in capsys.readouterr().err
