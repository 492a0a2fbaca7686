# SPDX-License-Identifier: Apache-2.0
"""Which ranks share a host, and how fast the links between hosts are, learned at start-up.

A heterogeneous cluster is several hosts joined by links that differ: traffic inside a host is
fast, between hosts it is not, and sometimes one host sits behind a slower link. The fork's
communication decisions (hierarchical reduction through host leaders, bucket sizes from the
slowest link) need both facts, measured rather than guessed.

Host identity. Namespaces (the emulated cluster of ``scripts/emulated_cluster.py``) and some
containers share one hostname, so the hostname is the last resort, in this order:

1. the launcher's node rank: DeepSpeed's launcher sets ``CROSS_RANK`` (``deepspeed/launcher/
   launch.py``), torchrun ``GROUP_RANK``;
2. the address of the socket interface the backend is told to use (``GLOO_SOCKET_IFNAME``, else
   ``NCCL_SOCKET_IFNAME``; the first name of a list);
3. the hostname.

The environment is read when discovery runs (``coordinator.coordinate``), not at import,
so a test can fake hosts by setting ``CROSS_RANK`` per rank before ``deepspeed.initialize``.

Bandwidth. With more than one host, the leader of host 0 (its lowest rank) sends a few MiB to the
leader of every other host and waits for a one-element reply, a few times; the median of those
round trips gives bytes/s of payload. Every rank takes part in the same group collectives (one
gather of host keys, one broadcast of the result); only leaders exchange the probe's point-to-point
messages, the others wait at the broadcast. On one host nothing is probed.

The pure part (``host_key``, ``topology_from_keys``, ``Topology``) is tested without processes;
``discover_topology`` is the edge.
"""

import os
import socket
import statistics
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence, Tuple

NODE_RANK_VARIABLES = ("CROSS_RANK", "GROUP_RANK")
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PROBE_BYTES = 4 * 2**20
PROBE_REPEATS = 3


@dataclass(frozen=True)
class Topology:
    """The hosts of the data-parallel ranks and the measured links between host leaders."""

    hosts: Tuple[int, ...]
    """The host index of each data-parallel rank: dense, 0..H-1 in order of first appearance."""
    leader_bandwidths: Tuple[Optional[float], ...] = ()
    """Per host, bytes/s measured between host 0's leader and this host's leader (None for host 0,
    and for every host when nothing was measured)."""
    source: str = ""
    """What identified the hosts: 'CROSS_RANK', 'GROUP_RANK', 'GLOO_SOCKET_IFNAME', ..., 'hostname'."""

    def __post_init__(self):
        if not self.hosts:
            raise ValueError("Topology.hosts: one host index per data-parallel rank, got none")
        seen = list(dict.fromkeys(self.hosts))
        if seen != list(range(len(seen))):
            raise ValueError(f"Topology.hosts must number hosts 0..H-1 in order of first appearance, got {self.hosts}")
        if self.leader_bandwidths and len(self.leader_bandwidths) != len(seen):
            raise ValueError(f"Topology.leader_bandwidths: one entry per host ({len(seen)}), "
                             f"got {len(self.leader_bandwidths)}")

    @property
    def num_hosts(self):
        return max(self.hosts) + 1

    @property
    def world_size(self):
        return len(self.hosts)

    @cached_property
    def _members(self):
        """Per host, its data-parallel ranks in rank order (one pass: O(N) for N ranks)."""
        members = [[] for _ in range(self.num_hosts)]
        for rank, host in enumerate(self.hosts):
            members[host].append(rank)
        return tuple(map(tuple, members))

    def ranks_of(self, host):
        """The data-parallel ranks on ``host``, in rank order."""
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host {host} is out of range: this topology has {self.num_hosts} host(s)")
        return self._members[host]

    @property
    def leaders(self):
        """Each host's leader: its lowest data-parallel rank."""
        return tuple(members[0] for members in self._members)

    @property
    def local_ranks(self):
        """Each data-parallel rank's position among its host's ranks."""
        position = {rank: index for members in self._members for index, rank in enumerate(members)}
        return tuple(position[rank] for rank in range(len(self.hosts)))

    @property
    def link_bandwidth(self):
        """Bytes/s of the slowest measured link between host leaders; None on one host or when
        nothing was measured."""
        measured = [b for b in self.leader_bandwidths if b is not None]
        return min(measured) if measured else None

    def describe(self):
        """One line, e.g. ``2 hosts (ranks 0,1 | 2,3), inter-host 187 Mbit/s measured``."""
        groups = " | ".join(",".join(map(str, self.ranks_of(host))) for host in range(self.num_hosts))
        line = f"{self.num_hosts} host{'s' if self.num_hosts > 1 else ''} (ranks {groups})"
        measured = [(h, b) for h, b in enumerate(self.leader_bandwidths) if b is not None]
        if not measured:
            return line + (", inter-host bandwidth not measured" if self.num_hosts > 1 else "")
        rates = {round(b * 8 / 1e6) for _, b in measured}
        if len(rates) == 1:
            return line + f", inter-host {rates.pop()} Mbit/s measured"
        links = ", ".join(f"0<->{h} {b * 8 / 1e6:.0f}" for h, b in measured)
        return line + f", inter-host Mbit/s measured: {links}"

    def to_dict(self):
        return {"hosts": list(self.hosts), "leader_bandwidths": list(self.leader_bandwidths), "source": self.source}


def topology_note(topology):
    """The line the start-up plan block shows under its title: ``topology: <describe()>`` on more
    than one host; None on one host or without a topology (nothing worth a line)."""
    if topology is None or topology.num_hosts == 1:
        return None
    return f"topology: {topology.describe()}"


def _interface_address(name):
    """The first IPv4 (else IPv6) address of network interface ``name``, or None."""
    import psutil
    addresses = psutil.net_if_addrs().get(name, ())
    for family in (socket.AF_INET, socket.AF_INET6):
        for address in addresses:
            if address.family == family:
                return address.address
    return None


def host_key(environ=None, interface_address=_interface_address, hostname=socket.gethostname):
    """(key, source) naming this process's host; see the module's docstring for the order.

    Args:
        environ: the environment to read (default: os.environ, read now).
        interface_address: name -> address or None (default: the machine's interfaces).
        hostname: () -> this machine's name.
    """
    environ = os.environ if environ is None else environ
    for variable in NODE_RANK_VARIABLES:
        value = environ.get(variable, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"deepspeed-hetero topology: {variable}={value!r} is not a node rank (a launcher "
                                 "sets it to an integer >= 0); unset it or set it to this host's node rank")
            return f"{variable}={int(value)}", variable
    for variable in INTERFACE_VARIABLES:
        value = environ.get(variable, "").strip()
        if value:
            # NCCL accepts '^lo,docker' (exclusions) and '=eth1' (exact); a name is what identifies a host.
            name = value.split(",")[0].lstrip("=")
            address = None if name.startswith("^") else interface_address(name)
            if address is not None:
                return f"{variable}={address}", variable
    return f"hostname={hostname()}", "hostname"


def topology_from_keys(keys: Sequence[str], sources: Sequence[str] = ()):
    """The Topology of data-parallel ranks whose hosts have ``keys`` (one per rank, in rank order).

    ``sources`` (one per rank, optional) must agree: a rank that found its host by another means
    than its peers (one launched with a node rank, one without) cannot be placed on a host with
    any confidence, and the result would be wrong silently."""
    if sources and len(set(sources)) > 1:
        by_source = {}
        for rank, source in enumerate(sources):
            by_source.setdefault(source, []).append(rank)
        shown = "; ".join(f"ranks {ranks} from {source}" for source, ranks in by_source.items())
        raise ValueError(f"deepspeed-hetero topology: the ranks identified their hosts by different means ({shown}). "
                         "Launch every host the same way (the deepspeed launcher sets CROSS_RANK, torchrun "
                         "GROUP_RANK), or set the same one of GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on every host")
    index = {}
    hosts = tuple(index.setdefault(key, len(index)) for key in keys)
    return Topology(hosts, source=sources[0] if sources else "")


def bandwidth_from_round_trips(payload_bytes, seconds):
    """Bytes/s from the probe's round trips (payload out, one element back): the median time, so
    that one disturbed repeat (a neighbour's burst, a page fault) does not move it."""
    if not seconds:
        return None
    median = statistics.median(seconds)
    return payload_bytes / median if median > 0 else None


# -- the edge: collectives ----------------------------------------------------------------------


def discover_topology(dp_rank, world_size, probe_bytes=PROBE_BYTES, repeats=PROBE_REPEATS):
    """The Topology of this run's data-parallel ranks, the same on every process.

    Collectives (every process, in this order): one gather of (data-parallel rank, host key);
    with more than one host, the leaders' point-to-point probe, then one broadcast of the
    measured bandwidths from global rank 0. A model-parallel replica is placed on the host of its
    lowest global rank. Without a process group (one process) the topology is one host."""
    from deepspeed import comm as dist

    from .agreement import Agreement

    key, source = host_key()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return Topology(tuple([0] * int(world_size)), source=source)
    agreement = Agreement(f"data-parallel rank {dp_rank}")
    gathered = agreement.gather_from_every_rank((int(dp_rank), key, source), "the host of every rank")
    # Per data-parallel rank, its lowest global rank's host (gathered is in global rank order).
    first = {}
    for global_rank, (rank, rank_key, rank_source) in enumerate(gathered):
        first.setdefault(rank, (global_rank, rank_key, rank_source))
    missing = [rank for rank in range(int(world_size)) if rank not in first]
    if missing:
        raise ValueError(f"deepspeed-hetero topology: no process reported data-parallel rank(s) {missing} of "
                         f"{world_size}; the mpu / mesh and the config disagree")
    topology = topology_from_keys([first[r][1] for r in range(int(world_size))],
                                  [first[r][2] for r in range(int(world_size))])
    if topology.num_hosts == 1:
        return topology
    # Leaders by global rank: the lowest process of each host key.
    leader_of_key = {}
    for global_rank, (_, rank_key, _) in enumerate(gathered):
        leader_of_key.setdefault(rank_key, global_rank)
    keys_in_host_order = list(dict.fromkeys(first[r][1] for r in range(int(world_size))))
    leaders = [leader_of_key[k] for k in keys_in_host_order]
    measured = _run_probe(leaders, probe_bytes, repeats)
    # The first host's leader measured (global rank 0 unless an unusual mpu puts dp rank 0 elsewhere).
    measured = agreement.broadcast_from(leaders[0], measured, "the measured inter-host bandwidth")
    return Topology(topology.hosts, tuple(measured), topology.source)


def _probe_device():
    from deepspeed.accelerator import get_accelerator

    from ..measure.devices import local_device_index
    accelerator = get_accelerator()
    return accelerator.device_name(local_device_index()) if accelerator.device_name() != "cpu" else "cpu"


def _run_probe(leaders, probe_bytes, repeats):
    """The probe's point-to-point part, on every leader (a no-op elsewhere). Host 0's leader sends
    ``probe_bytes`` to each other leader in turn, ``repeats`` times after one warm-up, and waits
    for a one-element reply each time; it returns the bandwidths (None for host 0), others None."""
    import torch

    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    rank = dist.get_rank()
    if rank not in leaders:
        return None
    device = _probe_device()
    payload = torch.zeros(max(1, probe_bytes // 4), dtype=torch.float32, device=device)
    reply = torch.zeros(1, dtype=torch.float32, device=device)
    accelerator = get_accelerator()
    if rank != leaders[0]:
        for _ in range(repeats + 1):
            dist.recv(payload, src=leaders[0])
            dist.send(reply, dst=leaders[0])
        return None
    bandwidths = [None]
    for peer in leaders[1:]:
        seconds = []
        for attempt in range(repeats + 1):
            accelerator.synchronize()
            start = time.perf_counter()
            dist.send(payload, dst=peer)
            dist.recv(reply, src=peer)
            accelerator.synchronize()
            if attempt > 0:  # the first one pays connection and allocation costs
                seconds.append(time.perf_counter() - start)
        bandwidths.append(bandwidth_from_round_trips(payload.numel() * 4, seconds))
    return bandwidths
