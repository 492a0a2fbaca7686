# SPDX-License-Identifier: Apache-2.0
"""The start-up control plane at scale: what the ranks gather is grouped per
replica in one pass, and a topology of 10,000 ranks groups its hosts once (pure; the collectives'
bytes and rounds against N are ``tests/perf/bench_control_plane.py``'s)."""

import pytest


def test_gathered_entries_are_grouped_per_replica_in_one_pass():
    from deepspeed.runtime.heterogeneous.cluster.agreement import by_replica, largest_per_replica, merge_replicas
    # Two model-parallel members per replica, in global rank order.
    pairs = [(rank // 2, rank * 10) for rank in range(8)]
    assert by_replica(pairs) == {0: [0, 10], 1: [20, 30], 2: [40, 50], 3: [60, 70]}
    assert largest_per_replica(pairs, 4) == [10, 30, 50, 70]
    assert largest_per_replica(pairs[:4], 3, default=0) == [10, 30, 0]
    with pytest.raises(ValueError, match="data-parallel rank 2"):
        largest_per_replica(pairs[:4], 3)
    contributions = [{"dp_rank": rank // 2, "steps": [rank, 1], "peak": rank} for rank in range(6)]
    merged = merge_replicas(contributions, 3, {"steps": lambda items, rank: max(items)})
    assert merged == [{"steps": [1, 1], "peak": 1}, {"steps": [3, 1], "peak": 3}, {"steps": [5, 1], "peak": 5}]


def test_a_topology_of_10000_ranks_groups_its_hosts_once():
    from deepspeed.runtime.heterogeneous.cluster.topology import Topology, topology_from_keys
    hosts = [rank // 8 for rank in range(10000)]
    topology = topology_from_keys([f"CROSS_RANK={h}" for h in hosts], ["CROSS_RANK"] * 10000)
    assert topology.num_hosts == 1250 and topology.ranks_of(3) == tuple(range(24, 32))
    assert topology.leaders == tuple(range(0, 10000, 8))
    assert topology.local_ranks == tuple(rank % 8 for rank in range(10000))
    interleaved = Topology((0, 1, 0, 2, 1))
    assert interleaved.ranks_of(1) == (1, 4) and interleaved.leaders == (0, 1, 3)
    assert interleaved.local_ranks == (0, 0, 1, 0, 1)
    assert interleaved == Topology((0, 1, 0, 2, 1))


class CountingStore:
    """A store's get and multi_get, counting round trips."""

    def __init__(self, values):
        self.values, self.round_trips = values, 0

    def get(self, key):
        self.round_trips += 1
        return self.values[key]

    def multi_get(self, keys):
        self.round_trips += 1
        return [self.values[key] for key in keys]


class StoreWithoutMultiGet(CountingStore):
    multi_get = None

    def __getattribute__(self, name):
        if name == "multi_get":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_rank_0_reads_every_ranks_settings_in_one_round_trip():
    from deepspeed.runtime.heterogeneous.cluster.agreement import _get_all
    keys = [f"deepspeed-hetero/settings/1/{rank}" for rank in range(1000)]
    values = {key: key.encode() for key in keys}
    store = CountingStore(values)
    assert _get_all(store, keys) == [key.encode() for key in keys] and store.round_trips == 1
    older = StoreWithoutMultiGet(values)
    assert _get_all(older, keys) == [key.encode() for key in keys] and older.round_trips == 1000
