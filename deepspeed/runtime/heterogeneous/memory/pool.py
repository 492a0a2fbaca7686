# SPDX-License-Identifier: Apache-2.0
"""``HeterogeneousMemoryPool``: where each rank's model state lives (docs/memory.md, "The memory pool").

On a cluster that mixes 80 GB and 24 GB devices the question "does it fit?" has a different
answer per rank, and host RAM is a second, shared budget: the ranks of one node offload into the
same memory. The pool holds both budgets and makes the placement decision in one place::

    pool = HeterogeneousMemoryPool(hbm_devices=["80GB", "24GB"], cpu_memory_limit="64GB")
    placement = pool.place(ModelStateSpec(num_parameters=3_000_000_000, zero_stage=2,
                                          param_bytes=2, master_bytes=4))
    placement.partition_shares      # each rank's share of the ZeRO-1/2/3 state (None: upstream's 1/N)
    print(pool.report())            # per rank: what lives where, and the room left
    pool.report().to_dict()         # the same as plain data

Budgets:
- ``hbm_devices``: one entry per data-parallel rank: a size (``"80GB"``, ``"24GiB"``, bytes, read
  with ``config/settings.parse_bytes``), a gathered ``DeviceDescription`` (its capacity, name,
  host and prior speed; a CPU rank's shared host RAM counts as no limit), or None (no limit
  known). A rank may fill ``hbm_utilization_threshold`` (default: the config's, 0.85) of its
  device.
- ``cpu_memory_limit``: the hard host budget of one node (host RAM is shared by the node's ranks),
  a size or None (no limit). ``hosts`` says which ranks share a node (default: the devices' host
  names, else one node).

The decision (``place``), in this order:
1. ZeRO-1/2/3 shares (``zero_partitions``): ``"auto"`` picks them from each rank's room and speed
   (``partitions.choose_partition_shares``), ``"even"`` keeps 1/N, a list is used as given. In
   ZeRO-3 a share is of every partitioned parameter, so of its gradient and optimizer state
   (``zero3_shards.py``). ZeRO-0 keeps everything whole.
2. A rank whose state still does not fit its device offloads its optimizer state (and fp32 master
   copy): all of it in ZeRO-1/2, where the shares are then chosen again so that the offloading
   rank carries the state its device no longer has to hold; in ZeRO-3 the fewest whole sub-groups
   that make it fit, the last first (``ModelStateSpec.sub_groups``; hundredths when they are
   unknown; all of it where partial offload is not possible). Ranks with room keep their state on
   the device. Offload goes to the host when ``cpu_offload`` allows it, else to NVMe.
3. Per node, the offloaded state of its ranks must fit ``cpu_memory_limit``; what does not goes to
   NVMe when ``nvme_offload`` allows it, the largest first. A rank on NVMe has all of its optimizer
   state there.
What cannot be placed is an error (``MemoryPlacementError``) naming the rank or node and the
numbers; ``strict=False`` records it in ``placement.problems`` instead. The decision's types are
``rank_placement.py``'s.

Parameters, gradients and activations always stay on the device. The pool decides and reports:
it allocates nothing and runs no collective, so every rank reaches the same placement from the
same inputs. Its two users decide through ``placement.engine_placement``: the engine builds one
when ``heterogeneous_memory.enabled`` (``startup.place_engine_state``, kept as
``state.memory_pool``), and ``deepspeed env_report --heterogeneous --config ds_config.json
--model-parameters N`` prints the placement a config would get
(``cli/env_report.config_placement_lines``).
"""

from collections import Counter
from dataclasses import replace

from ..config.settings import HeterogeneousMemoryConfig, parse_bytes
from ..measure.devices import DeviceDescription
from .rank_placement import HOST, NVME, MemoryPlacement, MemoryPlacementError, RankPlacement
from .report import DEVICE, MemoryReport
from .report import format_size as _size
from .spec import ModelStateSpec, offloaded_sub_groups, zero3_offload_fraction
from .partitions import check_shares, choose_partition_shares, is_even

DEFAULT_UTILIZATION = HeterogeneousMemoryConfig.model_fields["hbm_utilization_threshold"].default
OFFLOAD_KEY = "zero_optimization.heterogeneous_offload"


HOST_SHARD_ROUNDS = 20
"""Rounds of ``_auto_shares`` that settle the shares and the host shards' price together."""


class HeterogeneousMemoryPool:
    """Per-device budgets and a hard host budget per node, and the placement decision (module
    docstring). Pure: no collectives, nothing allocated.

    Args:
        hbm_devices: per data-parallel rank, a size ("80GB", bytes), a ``DeviceDescription`` or None.
        cpu_memory_limit: host budget of one node for offloaded state ("64GB", bytes), None: none.
        hbm_utilization_threshold: fraction of a device a rank may fill (the config's default).
        hosts: per rank, which node it is on (any labels); default: the devices' hosts, else one.
        speeds: per rank, a relative speed (> 0) for the "auto" shares; default: the devices'
            prior scores when every one is known, else equal.
        device_names: per rank, a name for reports and errors; default: the devices' names.
    """

    def __init__(self, hbm_devices, cpu_memory_limit=None, hbm_utilization_threshold=DEFAULT_UTILIZATION,
                 hosts=None, speeds=None, device_names=None):
        entries = list(hbm_devices or ())
        if not entries:
            raise ValueError("HeterogeneousMemoryPool: hbm_devices needs one entry per data-parallel rank "
                             "(a size such as '80GB', bytes, a DeviceDescription or None)")
        if not 0 < float(hbm_utilization_threshold) <= 1:
            raise ValueError(f"HeterogeneousMemoryPool: hbm_utilization_threshold {hbm_utilization_threshold!r} "
                             "must be in (0, 1]")
        devices = [e if isinstance(e, DeviceDescription) else None for e in entries]
        self.capacities = [_capacity(entry, index) for index, entry in enumerate(entries)]
        self.utilization = float(hbm_utilization_threshold)
        try:
            self.host_budget = None if cpu_memory_limit is None else parse_bytes(cpu_memory_limit)
        except ValueError as exc:
            raise ValueError(f"HeterogeneousMemoryPool: cpu_memory_limit: {exc}") from None
        world = len(entries)
        self.hosts = _dense_hosts(hosts if hosts is not None else
                                  [d.host for d in devices] if all(devices) else [0] * world, world)
        known = [d.spec_score for d in devices] if all(devices) else []
        self.speeds = [float(s) for s in (speeds if speeds is not None else
                                          known if known and all(s > 0 for s in known) else [1.0] * world)]
        if len(self.speeds) != world or not all(s > 0 for s in self.speeds):
            raise ValueError(f"HeterogeneousMemoryPool: speeds {list(self.speeds)} must give a positive speed to "
                             f"each of the {world} ranks")
        names = device_names or [d.name if d is not None else "-" for d in devices]
        self.device_names = [str(n) for n in names]
        self.placement = None
        self._model_state = None
        self._baselines = [0.0] * world
        self._peak_shares = None  # the placement's largest share, host shards, host count, predictions
        self._budgets = None

    @property
    def model_state(self):
        """The ``ModelStateSpec`` of the last ``place`` (None before it)."""
        return self._model_state

    @property
    def world_size(self):
        return len(self.capacities)

    @property
    def budgets(self):
        """Per rank, the bytes it may fill on its device (None: no limit known)."""
        key = (self.utilization, self.capacities)
        if self._budgets is None or self._budgets[0] != key:
            # Computed once (read at every placement); again if capacities or utilization change.
            self._budgets = (key, [None if c is None else c * self.utilization for c in self.capacities])
        return list(self._budgets[1])

    @classmethod
    def from_state(cls, state, world_size):
        """The pool of a running job: the gathered devices' capacities (emulated ones included,
        ``memory_capacities``), the topology's nodes and the ``heterogeneous_memory`` block."""
        # A device that reports no memory (0) has no known limit, as in the planner.
        capacities = [c if c else None for c in memory_capacities(state) or [None] * world_size]
        speeds = known_speeds(state.devices) if state.devices and len(state.devices) == world_size else None
        memory = state.settings.memory
        return cls(capacities, cpu_memory_limit=memory.cpu_memory_limit_bytes,
                   hbm_utilization_threshold=memory.hbm_utilization_threshold,
                   hosts=state.topology.hosts if state.topology is not None else None, speeds=speeds,
                   device_names=state.device_names or [f"rank {r}" for r in range(world_size)])

    # -- the decision ----------------------------------------------------------------------------

    def place(self, model_state, zero_partitions="auto", activation_bytes=None, cpu_offload=True,
              nvme_offload=False, strict=True, baseline_bytes=None):
        """Place ``model_state`` (a ``ModelStateSpec``) on the ranks; returns the ``MemoryPlacement``
        (also kept as ``self.placement`` for ``report``).

        Args:
            zero_partitions: "auto", "even" or one share per rank (ZeRO-1/2/3).
            activation_bytes: per rank, the activation bytes of its micro-batch, or None (unknown:
                the room left then still has to hold them).
            cpu_offload, nvme_offload: where a rank that does not fit may offload its optimizer state.
            baseline_bytes: per rank, the bytes in use on its device before the engine allocates
                (``meter.py``); None: 0. Counted in the predicted peak.
            strict: raise ``MemoryPlacementError`` for what cannot be placed; False: record it.
        """
        world = self.world_size
        activations = list(activation_bytes) if activation_bytes is not None else [None] * world
        if len(activations) != world:
            raise ValueError(f"activation_bytes has {len(activations)} entries for {world} ranks")
        baselines = [float(b or 0.0) for b in baseline_bytes] if baseline_bytes is not None else [0.0] * world
        if len(baselines) != world:
            raise ValueError(f"baseline_bytes has {len(baselines)} entries for {world} ranks")
        self._baselines = baselines
        self._peak_shares = None
        stage = model_state.zero_stage
        partitioned = stage >= 1 and world > 1
        if partitioned and zero_partitions not in ("auto", "even"):
            fixed = check_shares(zero_partitions, world)
        elif partitioned and zero_partitions == "auto":
            fixed = None
        else:
            fixed = tuple([1.0 / world] * world) if stage >= 1 else tuple([1.0] * world)
        # Where the device is the host (the CPU accelerator), offloading moves nothing off it.
        host_is_device = model_state.allocations is not None and model_state.allocations.host_is_device
        may_offload = ((cpu_offload or nvme_offload) and stage >= 1 and model_state.optimizer_device is None
                       and not host_is_device)
        offloaded = {}  # rank -> fraction of its optimizer state off the device
        while True:
            shares = fixed if fixed is not None else self._auto_shares(model_state, offloaded, activations)
            over = self._ranks(model_state, shares, offloaded, activations, over_only=True) if may_offload else ()
            if not over:
                ranks = self._ranks(model_state, shares, offloaded, activations)
                break
            if stage == 3:
                ranks = self._ranks(model_state, shares, offloaded, activations)
                offloaded.update({r: zero3_offload_fraction(ranks[r], model_state) for r in over})
            elif fixed is None:
                # One rank at a time, the one with the least memory first: re-sharing after each
                # lets the others keep their state on the device (a run of alike ranks at once,
                # ``_next_offloads``).
                offloaded.update(dict.fromkeys(self._next_offloads(model_state, over, offloaded, activations), 1.0))
            else:
                offloaded.update(dict.fromkeys(over, 1.0))
        ranks, problems = self._host_placement(ranks, nvme_offload, cpu_offload, model_state)
        problems = self._rank_problems([r for r in ranks if not r.fits], model_state, cpu_offload or nvme_offload
                                       ) + problems
        if strict and problems:
            raise MemoryPlacementError("; ".join(problems))
        if partitioned:
            shares_out = shares if fixed is not None and zero_partitions not in ("auto", "even") else (
                None if is_even(shares) else tuple(shares))
        else:
            shares_out = None
        self.placement = MemoryPlacement(stage, tuple(ranks), shares_out, self.host_budget, tuple(problems))
        self._model_state = model_state
        return self.placement

    def _auto_shares(self, model_state, offloaded, activations):
        """``choose_partition_shares`` with each rank's room for the partitioned state; an offloading
        rank's room is scaled by what a share costs it on the device (ZeRO-2: gradients; ZeRO-3: parameters
        and gradients)."""
        world = self.world_size
        if all(b is None for b in self.budgets):
            return choose_partition_shares(self.speeds)
        # What a rank holds whatever its share (share 0), and what all shares together hold.
        # Uneven shares: every rank flattens the largest owner's slice of a bucket; count it whole.
        held_whole = model_state.device_bytes(world, 0.0, largest_share=1.0)
        state_bytes = model_state.device_bytes(world, 1.0) - held_whole
        # What a share still costs an offloading rank on the device: ZeRO-2 its gradients, ZeRO-3 its
        # parameters and gradients too.
        whole_parts = model_state.parts(world, 1.0)
        gradient_bytes = {2: whole_parts.gradients, 3: whole_parts.gradients + whole_parts.parameters}.get(
            model_state.zero_stage, 0.0)
        rooms = []
        for rank, budget in enumerate(self.budgets):
            room = None if budget is None else budget - held_whole - (activations[rank] or 0.0) - self._baselines[rank]
            if room is not None and rank in offloaded:
                room = None if gradient_bytes == 0 else room * state_bytes / gradient_bytes
            rooms.append(room)
        shares = choose_partition_shares(self.speeds, rooms, state_bytes)
        if not (model_state.host_shards and model_state.zero_stage == 3 and state_bytes > 0):
            return shares
        # A rank's host shard costs the parameters once more in proportion to its share over its
        # host's. A rank alone on its host keeps the whole copy, whatever its share: its room
        # shrinks by that. The others' room for state shrinks by a per-share price that depends on
        # their host's total share, so settle it by rounds from the shares without host shards.
        whole = model_state.host_shard_bytes(1.0)
        per_host = Counter(self.hosts)
        alone = [per_host[host] == 1 for host in self.hosts]
        for _ in range(HOST_SHARD_ROUNDS):
            fractions = self.host_shard_fractions(model_state, shares)
            scaled = [room if room is None else max(0.0, room - whole) if lone else room if not share else
                      room * state_bytes / (state_bytes + whole * fraction / share)
                      for room, share, fraction, lone in zip(rooms, shares, fractions, alone)]
            previous, shares = shares, choose_partition_shares(self.speeds, scaled, state_bytes)
            if max(abs(a - b) for a, b in zip(previous, shares)) < 1e-6:
                break
        return shares

    def host_shard_fractions(self, model_state, shares):
        """Per rank, the fraction of the model its host shard holds (``comm/host_shards.py``: each
        host's copy cut in proportion to its ranks' shares), all 0 without host shards (the spec's
        ``host_shards``, ZeRO-3 on more than one host)."""
        world = self.world_size
        if not (model_state.host_shards and model_state.zero_stage == 3 and len(set(self.hosts)) > 1):
            return [0.0] * world
        host_totals = {}
        for host, share in zip(self.hosts, shares):
            host_totals[host] = host_totals.get(host, 0.0) + share
        return [share / host_totals[host] if host_totals[host] > 0 else 0.0 for host, share in zip(self.hosts, shares)]

    def _next_offloads(self, model_state, over, offloaded, activations):
        """The ZeRO-1/2 ranks that offload next under "auto" shares (``over``: the ranks over budget,
        not offloaded): the one with the least memory (the highest rank on a tie), then, one at a
        time, each rank alike it (the same budget, speed, activations and baseline, so next in that
        order) while it is the first over budget once those before it offload and the shares are
        chosen again. The count is found by trying the whole run, then by galloping and bisection
        (whether the k-th alike rank is still over only falls as k grows): k ranks cost O(log k)
        placements, not k (planning 1,024 ranks in under a second), and the ranks are those the
        one-at-a-time loop offloads."""
        world, budgets = self.world_size, self.budgets

        def first(ranks):
            return min(ranks, key=lambda r: (budgets[r], -r))

        def alike(rank):
            return (budgets[rank], self.speeds[rank], activations[rank], self._baselines[rank], rank == world - 1)

        run = []
        for rank in sorted(over, key=lambda r: (budgets[r], -r)):
            if run and alike(rank) != alike(run[0]):
                break
            run.append(rank)

        def next_over(count):
            """Whether run[count] is the first rank over budget once run[:count] offload too."""
            trial = {**offloaded, **dict.fromkeys(run[:count], 1.0)}
            still = self._ranks(model_state, self._auto_shares(model_state, trial, activations), trial, activations,
                                over_only=True)
            return bool(still) and first(still) == run[count]

        # The whole run first (a kind that does not fit offloads on all its ranks: one placement), then
        # galloping and bisection: O(log k) placements for the k alike ranks that offload.
        low, high = 1, len(run) + 1  # run[:low] offload; run[:high] do not all
        if len(run) > 1:
            if next_over(len(run) - 1):
                return run
            high = len(run)
        while low * 2 < high:
            if not next_over(low * 2 - 1):
                high = low * 2
                break
            low *= 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if next_over(middle - 1) else (low, middle)
        return run[:low]

    def _ranks(self, model_state, shares, offloaded, activations, over_only=False):
        """Each rank's ``RankPlacement`` under ``shares`` and ``offloaded`` (rank -> fraction);
        ``over_only``: only the ranks not in ``offloaded`` over their budget (their numbers)."""
        world, ranks = self.world_size, []
        host_shards = self.host_shard_fractions(model_state, shares)
        # Computed once, not per rank, and each distinct rank's parts, peak (and with over_only, fit)
        # once: a placement of N ranks costs O(N) (planning 1,024 ranks), most of them alike.
        budgets, largest, hosts = self.budgets, max(shares), len(set(self.hosts))
        forced = model_state.optimizer_device
        # choose_partition_shares rounds to millionths; the last share takes what the others' rounding left.
        slack = world * 1e-6 * model_state.device_bytes(world, 1.0) if model_state.zero_stage >= 1 else 0.0
        parts_of, peak_of, fits_of, placed_of = {}, {}, {}, {}
        for rank, share in enumerate(shares):
            if over_only and rank in offloaded:
                continue
            fraction = 1.0 if forced else offloaded.get(rank, 0.0)
            key = (share, fraction, activations[rank], self._baselines[rank], host_shards[rank])
            if over_only and (key, budgets[rank]) in fits_of:
                if not fits_of[key, budgets[rank]]:
                    ranks.append(rank)
                continue
            if not over_only and key in placed_of:
                ranks.append(placed_of[key].alike(rank=rank, host=self.hosts[rank], name=self.device_names[rank],
                                                  capacity_bytes=self.capacities[rank], budget_bytes=budgets[rank]))
                continue
            part = share if model_state.zero_stage >= 1 else None
            if part not in parts_of:
                parts_of[part] = model_state.parts(world, part)
            parts = parts_of[part]
            sub_groups = offloaded_sub_groups(model_state.sub_groups, fraction) if model_state.zero_stage == 3 else None
            peak = None
            if model_state.allocations is not None:
                if key not in peak_of:
                    prediction = model_state.peak(share, fraction, activations[rank], self._baselines[rank],
                                                  largest_share=largest, host_shard=host_shards[rank], hosts=hosts)
                    peak_of[key] = (prediction.peak_bytes, prediction.peak_phase)
                peak = peak_of[key]
            placed = RankPlacement(
                rank=rank, host=self.hosts[rank], name=self.device_names[rank], capacity_bytes=self.capacities[rank],
                budget_bytes=budgets[rank], share=share,
                parameter_bytes=parts.parameters + model_state.host_shard_bytes(host_shards[rank]),
                gradient_bytes=parts.gradients, optimizer_bytes=parts.optimizer, activation_bytes=activations[rank],
                optimizer_location=(NVME if forced == "nvme" else HOST) if fraction > 0 else DEVICE,
                offload_fraction=fraction, offload_sub_groups=sub_groups, slack_bytes=slack,
                baseline_bytes=self._baselines[rank], predicted_peak_bytes=None if peak is None else peak[0],
                peak_phase=None if peak is None else peak[1])
            if over_only:
                fits_of[key, budgets[rank]] = placed.fits
                if not placed.fits:
                    ranks.append(rank)
            else:
                placed_of[key] = placed
                ranks.append(placed)
        return ranks

    def _host_placement(self, ranks, nvme_offload, cpu_offload=True, model_state=None):
        """Keep each node's offloaded state within the host budget: the largest go to NVMe when
        allowed (all of them when only NVMe is allowed); what still does not fit is a problem naming
        the node. A rank on NVMe has all of its optimizer state there (upstream's NVMe offload has
        no ratio)."""
        def to_nvme(rank):
            whole = len(model_state.sub_groups) if model_state is not None and model_state.sub_groups else None
            return replace(rank, optimizer_location=NVME, offload_fraction=1.0,
                           offload_sub_groups=whole if rank.offload_sub_groups is not None else None)

        ranks = list(ranks)
        if nvme_offload and not cpu_offload:
            ranks = [to_nvme(r) if r.host_bytes > 0 else r for r in ranks]
        if self.host_budget is None:
            return ranks, []
        problems, offloading = [], {}
        for rank in ranks:
            if rank.host_bytes > 0:
                offloading.setdefault(rank.host, []).append(rank)
        for host in sorted(set(self.hosts)):
            on_host = sorted(offloading.get(host, ()), key=lambda r: -r.host_bytes)
            total = sum(r.host_bytes for r in on_host)
            for moved in on_host:
                if total <= self.host_budget or not nvme_offload:
                    break
                ranks[moved.rank] = to_nvme(moved)
                total -= moved.host_bytes
            if total > self.host_budget:
                offloads = ", ".join(f"rank {r.rank}: {_size(r.host_bytes)}" for r in on_host
                                     if ranks[r.rank].optimizer_location == HOST)
                problems.append(
                    f"node {host} (data-parallel ranks {[r for r, h in enumerate(self.hosts) if h == host]}) would "
                    f"offload {_size(total)} of optimizer state to its host ({offloads}), more than "
                    f"heterogeneous_memory.cpu_memory_limit {_size(self.host_budget)}; raise the limit, allow NVMe "
                    f"({OFFLOAD_KEY}.nvme_offload), use a higher ZeRO stage or give the ranks more device memory")
        return ranks, problems

    def _rank_problems(self, ranks, model_state, offload_allowed):
        """``rank_problem`` of each of ``ranks``, what follows the label written once for ranks placed
        alike (a plan of 1,024 ranks that do not fit names each of them)."""
        said, problems = {}, []
        for rank in ranks:
            key = tuple(value for name, value in rank.__dict__.items() if name not in ("rank", "host", "name"))
            if key not in said:
                said[key] = self._rank_need(rank, model_state, offload_allowed)
            problems.append(f"{_rank_label(rank)} {said[key]}")
        return problems

    def rank_problem(self, rank, model_state, offload_allowed):
        """Why ``rank`` (a ``RankPlacement``) does not fit, with the numbers and what to change."""
        return f"{_rank_label(rank)} {self._rank_need(rank, model_state, offload_allowed)}"

    def _rank_need(self, rank, model_state, offload_allowed):
        held = (f"parameters {_size(rank.parameter_bytes)} + gradients {_size(rank.gradient_bytes)} + optimizer "
                f"state {_size(rank.optimizer_bytes - rank.offloaded_bytes)}" +
                (f" + activations {_size(rank.activation_bytes)}" if rank.activation_bytes else "") +
                (f" + DeepSpeed's buffers {_size(rank.buffer_bytes)} + {_size(rank.baseline_bytes)} in use at the "
                 f"engine's start, its predicted peak at {rank.peak_phase}" if rank.predicted_peak_bytes else ""))
        budget = (f"its budget {_size(rank.budget_bytes)} ({self.utilization:.0%} of {_size(rank.capacity_bytes)}, "
                  "heterogeneous_memory.hbm_utilization_threshold)")
        host_is_device = model_state.allocations is not None and model_state.allocations.host_is_device
        # ZeRO-3 has no higher stage: what it holds beyond its share is its buckets.
        smaller = ("use a higher ZeRO stage, smaller buckets" if model_state.zero_stage < 3 else
                   "use smaller buckets (zero_optimization.reduce_bucket_size, stage3_prefetch_bucket_size, "
                   "stage3_max_live_parameters, stage3_max_reuse_distance)")
        if host_is_device and model_state.zero_stage >= 1:
            advice = ("its device is the host (the CPU accelerator), where offloading moves nothing off it: "
                      f"{smaller}, or give the rank more memory")
        elif model_state.zero_stage == 0:
            advice = "ZeRO stage 0 cannot offload: use ZeRO stage 1-3, or give the rank more memory"
        elif rank.offload_fraction >= 1.0:
            advice = f"even with all its optimizer state offloaded: {smaller}, or give it more memory"
        elif not offload_allowed and model_state.optimizer_device is None:
            advice = (f"offloading its optimizer state ({_size(rank.optimizer_bytes)}) would leave "
                      f"{_size(rank.device_bytes - rank.optimizer_bytes)}: allow it with {OFFLOAD_KEY}.cpu_offload "
                      f"(or nvme_offload), {smaller}, or give the rank more memory")
        else:
            advice = f"{smaller}, or give the rank more memory"
        fits_in = "" if rank.capacity_bytes is None else (
            f" (it would fit a capacity of {_size(rank.device_bytes / self.utilization)})")
        return f"needs {_size(rank.device_bytes)} on its device ({held}), more than {budget}; {advice}{fits_in}"

    def predicted_peak(self, rank, activation_bytes=0.0):
        """``peak.PeakPrediction`` of a placed rank with ``activation_bytes`` of activations,
        or None before ``place`` or where the allocations are unknown."""
        if self.placement is None or self._model_state is None or self._model_state.allocations is None:
            return None
        placed = self.placement.ranks[rank]
        # The shares' largest and host shards, computed once per placement (not per rank: O(N) per call
        # made a plan of N ranks O(N^2)); keyed by the shares, which record_* and revise_* keep.
        # Ranks placed alike share one prediction (not to be modified).
        shares = tuple(r.share for r in self.placement.ranks) if self._peak_shares is None else None
        if shares is not None:
            self._peak_shares = (max(shares), self.host_shard_fractions(self._model_state, shares),
                                 len(set(self.hosts)), {})
        largest, host_shards, hosts, predictions = self._peak_shares
        key = (placed.share, placed.offload_fraction, activation_bytes, placed.baseline_bytes, host_shards[rank])
        if key not in predictions:
            predictions[key] = self._model_state.peak(placed.share, placed.offload_fraction, activation_bytes,
                                                      placed.baseline_bytes, largest_share=largest,
                                                      host_shard=host_shards[rank], hosts=hosts)
        return predictions[key]

    def revise_allocations(self, **changes):
        """What the engine settled after the placement (the overlap worker off, where the placement
        counted its buckets as possible): later predictions (``predicted_peak``) use the revised
        allocations; the placement and its shares stay."""
        if self._model_state is not None and self._model_state.allocations is not None:
            self._model_state = replace(self._model_state,
                                        allocations=replace(self._model_state.allocations, **changes))
            self._peak_shares = None

    def record_activations(self, rank, activation_bytes):
        """Count a rank's measured activation bytes (its micro-batch's, ``memory.ActivationMeter``)
        in its row and its predicted peak. The largest micro-batch's count stays: the measured peak
        the prediction is shown beside is a high-water mark since the engine started."""
        if self.placement is None:
            return
        placed = self.placement.ranks[rank]
        if placed.activation_bytes is not None and activation_bytes <= placed.activation_bytes:
            return
        update = {"activation_bytes": float(activation_bytes)}
        peak = self.predicted_peak(rank, activation_bytes)
        if peak is not None:
            update.update(predicted_peak_bytes=peak.peak_bytes, peak_phase=peak.peak_phase)
        ranks = list(self.placement.ranks)
        ranks[rank] = replace(placed, **update)
        self.placement = replace(self.placement, ranks=tuple(ranks))

    def record_measured_peaks(self, peaks):
        """Record each rank's measured peak (bytes, None where unknown) in the placement the
        report shows (``meter.py``; gathered from every rank by the runtime)."""
        if self.placement is None:
            return
        ranks = tuple(r if peak is None else replace(r, measured_peak_bytes=int(peak))
                      for r, peak in zip(self.placement.ranks, peaks))
        self.placement = replace(self.placement, ranks=ranks)

    # -- the report ------------------------------------------------------------------------------

    def report(self):
        """Per rank, where parameters, gradients, optimizer state and activations live and the room
        left, for the last ``place`` (budgets only before it): ``str()`` is a table, ``to_dict()``
        plain data."""
        return MemoryReport(self, self.placement)


def _rank_label(rank):
    return f"data-parallel rank {rank.rank}" + ("" if rank.name == "-" else f" ({rank.name})")


def _capacity(entry, index):
    if entry is None:
        return None
    if isinstance(entry, DeviceDescription):
        return None if entry.shared_host_memory else int(entry.memory_bytes)
    try:
        size = parse_bytes(entry)
    except ValueError as exc:
        raise ValueError(f"HeterogeneousMemoryPool: hbm_devices[{index}]: {exc}, a DeviceDescription or "
                         "None") from None
    if size <= 0:
        raise ValueError(f"HeterogeneousMemoryPool: hbm_devices[{index}] = {entry!r} must be a positive size")
    return size


def _dense_hosts(hosts, world):
    hosts = list(hosts)
    if len(hosts) != world:
        raise ValueError(f"HeterogeneousMemoryPool: hosts {hosts} must name the node of each of the {world} ranks")
    order = {host: index for index, host in enumerate(dict.fromkeys(hosts))}
    return [order[h] for h in hosts]


# -- the engine's and the env report's pools ------------------------------------------------------


def known_speeds(devices):
    """The devices' prior speeds when every one is known (> 0), else None (equal speeds)."""
    known = [d.spec_score for d in devices]
    return known if known and all(s > 0 for s in known) else None


__all__ = ["HeterogeneousMemoryPool", "MemoryReport", "ModelStateSpec", "known_speeds"]


def init_prior_shares(state, world_size):
    """``"auto"``'s ZeRO-3 shares in ``zero.Init``, where the devices are gathered but the model does not
    exist yet (None: equal slices). The engine's rule (``choose_partition_shares``: shares by speed,
    none above what its memory holds) for a model as large as the ranks can hold together, the reason
    to build it under ``zero.Init``: each rank's share is its part of the memory budgets, and ranks of
    unknown memory share what is left by speed. The engine, which knows the model, revisits the cut
    once (``startup.place_engine_state``)."""
    if not state.devices or len(state.devices) != int(world_size) or int(world_size) < 2:
        return None
    pool = HeterogeneousMemoryPool.from_state(state, world_size)
    known = [b for b in pool.budgets if b is not None]
    shares = choose_partition_shares(pool.speeds, pool.budgets, sum(known)) if known else \
        choose_partition_shares(pool.speeds)
    return None if is_even(shares) else shares


def memory_capacities(state):
    """Per data-parallel rank, the device memory plans must fit in (bytes), or None where no limit
    is known: the CPU accelerator reports host RAM, which its ranks share, so there a limit comes
    only from an emulated capacity."""
    devices = state.devices
    if not devices:
        return None
    emulation = state.settings.config.emulation
    if emulation is not None and emulation.memory_gb:
        return [d.memory_bytes for d in devices]
    capacities = [None if d.shared_host_memory else d.memory_bytes for d in devices]
    return capacities if any(c is not None for c in capacities) else None
