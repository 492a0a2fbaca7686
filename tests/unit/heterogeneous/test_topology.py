# SPDX-License-Identifier: Apache-2.0
"""Which ranks share a host and the measured links between host leaders
(``deepspeed/runtime/heterogeneous/cluster/topology.py``): the pure rules, and a run on this machine whose
ranks play different hosts by their ``CROSS_RANK`` (the real multi-host run is test_multihost.py)."""

import math
import os

import pytest

from deepspeed.runtime.heterogeneous.cluster.topology import (Topology, bandwidth_from_round_trips, host_key,
                                                              topology_from_keys, topology_note)
from harness import run_subcases


def no_interface(name):
    return None


def test_the_launchers_node_rank_names_the_host_before_the_interface_and_the_hostname():
    everything = {"CROSS_RANK": "1", "GROUP_RANK": "0", "GLOO_SOCKET_IFNAME": "eth1"}
    address = {"eth1": "10.0.0.2"}.get
    assert host_key(everything, address, lambda: "vm") == ("CROSS_RANK=1", "CROSS_RANK")
    assert host_key({"GROUP_RANK": "3"}, address, lambda: "vm") == ("GROUP_RANK=3", "GROUP_RANK")
    # Namespaces share a hostname: the socket interface's address tells them apart.
    assert host_key({"GLOO_SOCKET_IFNAME": "eth1"}, address, lambda: "vm") == ("GLOO_SOCKET_IFNAME=10.0.0.2",
                                                                               "GLOO_SOCKET_IFNAME")
    assert host_key({"NCCL_SOCKET_IFNAME": "=eth1,eth2"}, address, lambda: "vm")[0] == "NCCL_SOCKET_IFNAME=10.0.0.2"
    # An exclusion list names no interface; an interface without an address is no identity.
    assert host_key({"NCCL_SOCKET_IFNAME": "^lo,docker"}, address, lambda: "vm") == ("hostname=vm", "hostname")
    assert host_key({"GLOO_SOCKET_IFNAME": "ib0"}, no_interface, lambda: "vm") == ("hostname=vm", "hostname")
    assert host_key({}, no_interface, lambda: "vm") == ("hostname=vm", "hostname")


def test_a_node_rank_that_is_not_a_number_is_refused_by_name():
    with pytest.raises(ValueError, match="CROSS_RANK='node-a' is not a node rank"):
        host_key({"CROSS_RANK": "node-a"}, no_interface, lambda: "vm")


def test_the_environment_is_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.setenv("CROSS_RANK", "7")
    assert host_key()[0] == "CROSS_RANK=7"
    monkeypatch.setenv("CROSS_RANK", "2")
    assert host_key()[0] == "CROSS_RANK=2"


def test_hosts_are_numbered_densely_in_order_of_first_appearance():
    topology = topology_from_keys(["n=5", "n=5", "n=2", "n=9", "n=2"], ["CROSS_RANK"] * 5)
    assert topology.hosts == (0, 0, 1, 2, 1)
    assert topology.num_hosts == 3 and topology.world_size == 5
    assert topology.ranks_of(1) == (2, 4)
    assert topology.leaders == (0, 2, 3)
    assert topology.local_ranks == (0, 1, 0, 0, 1)
    assert topology.link_bandwidth is None  # nothing measured
    assert topology.source == "CROSS_RANK"
    with pytest.raises(ValueError, match="host 3 is out of range: this topology has 3 host"):
        topology.ranks_of(3)


def test_ranks_that_found_their_hosts_by_different_means_are_refused():
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] from CROSS_RANK; ranks \[2\] from hostname"):
        topology_from_keys(["CROSS_RANK=0", "CROSS_RANK=0", "hostname=vm"], ["CROSS_RANK", "CROSS_RANK", "hostname"])


def test_a_topology_must_number_its_hosts_densely():
    with pytest.raises(ValueError, match="0..H-1 in order of first appearance"):
        Topology((1, 0))
    with pytest.raises(ValueError, match="one entry per host"):
        Topology((0, 1), leader_bandwidths=(None,))


def test_the_slowest_measured_link_is_the_link_bandwidth_and_the_description_names_the_hosts():
    one_host = Topology((0, 0))
    assert one_host.link_bandwidth is None and one_host.describe() == "1 host (ranks 0,1)"
    two = Topology((0, 0, 1, 1), (None, 187e6 / 8))
    assert two.describe() == "2 hosts (ranks 0,1 | 2,3), inter-host 187 Mbit/s measured"
    three = Topology((0, 1, 2), (None, 200e6 / 8, 20e6 / 8))
    assert three.link_bandwidth == 20e6 / 8
    assert three.describe() == "3 hosts (ranks 0 | 1 | 2), inter-host Mbit/s measured: 0<->1 200, 0<->2 20"
    assert Topology((0, 1)).describe() == "2 hosts (ranks 0 | 1), inter-host bandwidth not measured"
    # The start-up plan block shows it on more than one host only.
    assert topology_note(two) == "topology: " + two.describe()
    assert topology_note(one_host) is None and topology_note(None) is None


def test_the_probe_takes_the_median_round_trip():
    assert bandwidth_from_round_trips(1000, [0.5, 0.01, 0.1]) == pytest.approx(10000)
    assert bandwidth_from_round_trips(1000, []) is None


def _discover(rank, world_size, hosts_of):
    """This rank plays host ``hosts_of[rank]`` (None: no CROSS_RANK), then initializes the fork."""
    import deepspeed
    import torch

    if hosts_of[rank] is None:
        os.environ.pop("CROSS_RANK", None)
    else:
        os.environ["CROSS_RANK"] = str(hosts_of[rank])
    model = torch.nn.Linear(4, 4)
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform"}}
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.pop("CROSS_RANK", None)
    return engine._config.heterogeneous.topology


@pytest.mark.multiprocess
def test_ranks_playing_two_hosts_see_two_hosts_and_a_measured_link():
    cases = [dict(hosts_of=[0, 1]), dict(hosts_of=[4, 4]), dict(hosts_of=[0, None])]
    two_hosts, one_host, mixed = run_subcases(_discover, cases, world_size=2, timeout=300)
    for topology in two_hosts:
        assert topology.hosts == (0, 1) and topology.source == "CROSS_RANK"
        assert topology.leader_bandwidths[0] is None
        # Loopback between two processes: measured (how fast is a benchmark's question).
        assert math.isfinite(topology.link_bandwidth) and topology.link_bandwidth > 0, topology
    assert two_hosts[0] == two_hosts[1], "every rank must hold the same topology"
    for topology in one_host:
        assert topology.hosts == (0, 0) and topology.link_bandwidth is None  # one host: nothing probed
    for message in mixed:
        assert "identified their hosts by different means" in message, message
