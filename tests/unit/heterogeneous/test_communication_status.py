# SPDX-License-Identifier: Apache-2.0
"""What of ``heterogeneous_config.communication`` is in force, in words: Active only where a
part acts (ranks on several hosts), and from a config alone what ``auto`` would switch on; the
env report's line after ``Communication Optimization``."""

import io
import json

import pytest

from deepspeed.runtime.heterogeneous.comm.status import communication_status, status_line
from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
from deepspeed.runtime.heterogeneous.cli.env_report import heterogeneous_report
from deepspeed.runtime.heterogeneous.cluster.topology import Topology

TWO_HOSTS = Topology((0, 0, 1, 1), (None, 25e6), "CROSS_RANK")  # 200 Mbit/s measured
ZERO2 = {"zero_optimization": {"stage": 2}}


def settings(communication=None, enabled=True):
    block = {"enabled": enabled, **({"communication": communication} if communication is not None else {})}
    return load_heterogeneous_settings({"heterogeneous_config": block}, environ={})


def test_from_a_config_alone_it_says_what_auto_switches_on_across_hosts():
    active, parts = communication_status(settings())
    assert active is False
    assert parts == [
        "hierarchical reduction auto: on when the data-parallel ranks span more than one host",
        "link-aware buckets auto: on when the data-parallel ranks span more than one host, sized from the "
        "measured link"]


def test_on_two_hosts_every_part_in_force_is_named():
    active, parts = communication_status(settings({"compress_inter_host": "bf16"}), TWO_HOSTS, ZERO2)
    assert active is True
    assert parts == ["hierarchical reduction on",
                     "link-aware buckets reduce_bucket_size 1e+06, allgather_bucket_size 1e+06 elements "
                     "(50 ms at 200 Mbit/s)",
                     "inter-host step compressed to bf16",
                     "gradient buckets reduced during the backward where they can be captured"]
    assert status_line(settings(), TWO_HOSTS, ZERO2).startswith("Active (hierarchical reduction on; link-aware")
    _, parts = communication_status(settings({"compress_inter_host": "lossless"}), TWO_HOSTS, ZERO2)
    assert parts[2] == "inter-host exchanges coded losslessly"
    # It codes the all-to-all exchanges between hosts, not an all-reduce between them.
    for zero, said in (({"stage": 0}, "codes nothing here (ZeRO-0's all-reduce between hosts travels raw)"),
                       ({"stage": 2, "reduce_scatter": False}, "the gradient all-reduce of reduce_scatter false "
                                                               "travels raw")):
        _, parts = communication_status(settings({"compress_inter_host": "lossless"}), TWO_HOSTS,
                                        {"zero_optimization": zero})
        assert any(said in part for part in parts), parts


@pytest.mark.parametrize("communication, topology, param_dict, active, expected", [
    ({"hierarchical_reduction": False, "link_aware_buckets": False}, TWO_HOSTS, ZERO2, False,
     ["hierarchical reduction off", "link-aware buckets off"]),
    ({}, Topology((0, 0)), ZERO2, False,
     ["hierarchical reduction off (the data-parallel ranks run on one host)",
      "link-aware buckets off (the data-parallel ranks run on one host)"]),
    ({"link_aware_buckets": False}, TWO_HOSTS, {"zero_optimization": {"stage": 3}}, True,
     ["hierarchical reduction on (ZeRO-3: the gradient reduce-scatter; parameter gathers inside each host, from "
      "host shards, where they apply)",
      "link-aware buckets off", "gradient buckets reduced during the backward where they can be captured"]),
    ({"link_aware_buckets": False, "zero3_host_shards": False}, TWO_HOSTS, {"zero_optimization": {"stage": 3}}, True,
     ["hierarchical reduction on (ZeRO-3: the gradient reduce-scatter; parameter gathers stay flat)",
      "link-aware buckets off", "gradient buckets reduced during the backward where they can be captured"]),
    ({"hierarchical_reduction": False}, Topology((0, 1, 1), (None, 25e6)),
     {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1024, "allgather_bucket_size": 1024}}, False,
     ["hierarchical reduction off", "link-aware buckets off (the config sets every bucket size)"]),
    ({"link_aware_buckets": False, "overlap": False}, Topology((0, 0, 1)), ZERO2, True,
     ["hierarchical reduction on", "link-aware buckets off", "overlap off"]),  # uneven hosts: through the leaders
])
def test_what_is_not_in_force_says_why(communication, topology, param_dict, active, expected):
    assert communication_status(settings(communication), topology, param_dict) == (active, expected)


def test_compression_without_the_reduction_is_not_in_force():
    active, parts = communication_status(settings({"compress_inter_host": "fp16"}), Topology((0, 0)), ZERO2)
    assert active is False and parts[-1] == "inter-host step compressed to fp16: with the hierarchical reduction"
    _, parts = communication_status(settings({"compress_inter_host": "lossless"}), Topology((0, 0)), ZERO2)
    assert parts[-1] == "inter-host exchanges coded losslessly: with the hierarchical reduction"


def test_the_fork_off_is_off():
    assert communication_status(settings(enabled=False), TWO_HOSTS) == (
        False, ["off (heterogeneous_config.enabled is false)"])


def test_the_env_report_prints_the_parts_after_the_status_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"heterogeneous_config": {"enabled": True,
                                                         "communication": {"link_aware_buckets": False}}}))
    output = io.StringIO()
    heterogeneous_report(str(path), file=output)
    lines = output.getvalue().splitlines()
    index = lines.index("Communication Optimization: Inactive")
    assert lines[index + 1] == ("  hierarchical reduction auto: on when the data-parallel ranks span "
                                "more than one host; link-aware buckets off")
