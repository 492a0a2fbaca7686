# SPDX-License-Identifier: Apache-2.0
"""Ranks as they really are: several devices per host, other kinds of parallelism, ranks whose
settings disagree.

- A host with two accelerators: each rank describes its own device (name, memory), and the
  manual-by-name plan, the datasheet priors and the memory limits use those descriptions. The
  host is DeepSpeed's CPU accelerator subclassed to report two named devices with their own
  memory, installed with ``deepspeed.accelerator.set_accelerator``.
- The data-parallel rank is derived once, at config time, from the grouping the engine reduces
  gradients over (a sequence-parallel mpu, a device mesh), and the training loader uses it.
- Start-up priors respect memory: an H100 next to a V100 does not start at 8:1 where memory
  would not hold it.
- The pipeline engine is refused with heterogeneous_config enabled.
- Every rank must run the same heterogeneous settings: a difference in the environment or the
  config, or a rank that runs without the fork, ends in an error that names them on every rank.

All cases run in one spawned group of two ranks (start-up is paid once); cases that leave
process-wide state behind (a device mesh in ``groups``) run last.
"""

import pytest
import torch

from harness import patched_environ, run_subcases

WIDTH = 8
H100, V100 = "NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-16GB"
GIB = 2**30


def _two_device_host(names, memory_gib):
    """DeepSpeed's CPU accelerator on a host with two devices that have names and memory of their
    own (what a two-GPU node reports), indexed like CUDA devices."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class TwoDeviceHost(CPU_Accelerator):

        def device_count(self):
            return 2

        def get_device_name(self, device_index=None):
            return names[int(device_index or 0)]

        def total_memory(self, device_index=None):
            return int(memory_gib[int(device_index or 0)] * GIB)

    return TwoDeviceHost()


def _dataset(size=64):
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(size, WIDTH, generator=generator),
                                          torch.randn(size, WIDTH, generator=generator))


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(), torch.nn.Linear(16, WIDTH))


def _config(heterogeneous, train_batch_size=18, **extra):
    return {"train_batch_size": train_batch_size, "zero_optimization": {"stage": 0},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
            "heterogeneous_config": {"enabled": True, "profile_steps": 0, **heterogeneous}, **extra}


# -- the rank-side cases -----------------------------------------------------------------------


def _own_device(rank, memory_gib, heterogeneous, train_batch_size=18):
    """Train one step on the two-device host; what this rank described and ran."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator, set_accelerator

    saved = get_accelerator()
    set_accelerator(_two_device_host([H100, V100], memory_gib))
    try:
        model = _model()
        engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=_config(heterogeneous, train_batch_size),
                                                    training_data=_dataset())
        batches = iter(loader)
        while engine.global_steps < 1:  # one optimizer step, whatever this rank's gas
            inputs, targets = next(batches)
            engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
            engine.step()
        devices = engine.heterogeneous_devices
        return {"names": [d.name for d in devices], "memory": [d.memory_bytes for d in devices],
                "plan": list(engine.heterogeneous_plan.micro_batch_sizes), "notes": engine.heterogeneous_plan.notes,
                "gas": list(engine.heterogeneous_plan.gradient_accumulation_steps),
                "mbs": engine.train_micro_batch_size_per_gpu(), "fed": len(inputs)}
    finally:
        set_accelerator(saved)


def _settings(rank, env, heterogeneous, config_block=True):
    """Build and coordinate a config with this rank's own environment (``env[rank]``), as an engine
    would as it starts; the error, if any."""
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.heterogeneous.cluster import agreement

    agreement.SETTINGS_TIMEOUT_S = 4  # a rank without the fork never reports; do not wait for long
    config = {"train_batch_size": 8}
    if config_block:
        config["heterogeneous_config"] = {"enabled": True, "load_balancing_strategy": "compute_aware",
                                          "mixed_precision_support": "config", **heterogeneous[rank]}
    try:
        with patched_environ(env[rank]):
            built = ds_config.DeepSpeedConfig(config)
            built.heterogeneous.coordinate(built)
        return {"enabled": built.heterogeneous.enabled, "error": None}
    except ValueError as exc:
        return {"enabled": None, "error": str(exc)}


def _new_default_group(rank):
    """Coordinate a config, then one more on a new default group whose object rank 1 sees at the
    old one's ``id()`` (CPython may reuse a destroyed group's address on some ranks only); how many
    settings agreements each rank ran for the second config, or its error."""
    from torch.distributed import distributed_c10d
    from deepspeed import comm as dist
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.heterogeneous import coordinator as fork_coordinator
    from deepspeed.runtime.heterogeneous.cluster import agreement

    agreement.SETTINGS_TIMEOUT_S = 4  # a rank that skips the agreement: its peer's wait ends soon
    config = {"train_batch_size": 8, "heterogeneous_config": {"enabled": True, "mixed_precision_support": "config"}}
    first = ds_config.DeepSpeedConfig(dict(config))
    first.heterogeneous.coordinate(first)
    old_group, new_group = distributed_c10d._get_default_group(), dist.new_group(ranks=[0, 1])
    # The new default group of a destroy_process_group / init_process_group pair; destroying the real
    # one here would take the harness's groups with it.
    get_default_group = distributed_c10d._get_default_group
    distributed_c10d._get_default_group = lambda: new_group
    if rank == 1:
        fork_coordinator.id = lambda obj: id(old_group) if obj is new_group else id(obj)
    rounds = agreement._rounds
    try:
        second = ds_config.DeepSpeedConfig(dict(config))
        second.heterogeneous.coordinate(second)
        return agreement._rounds - rounds
    except ValueError as exc:
        return str(exc)
    finally:
        distributed_c10d._get_default_group = get_default_group
        vars(fork_coordinator).pop("id", None)
        dist.destroy_process_group(new_group)


def _pipeline(rank):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    layers = [torch.nn.Linear(WIDTH, 16), torch.nn.Tanh(), torch.nn.Linear(16, WIDTH)]
    model = PipelineModule(layers=layers, num_stages=1, loss_fn=torch.nn.MSELoss())
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(),
                             config=_config({"load_balancing_strategy": "uniform"}, 8))
    except ValueError as exc:
        return str(exc)
    return None


def _sequence_parallel_mpu(rank):
    """Ulysses' mpu (no data-parallel calls): both ranks are one replica's sequence-parallel pair."""
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(2)
    config = ds_config.DeepSpeedConfig(_config({"load_balancing_strategy": "compute_aware"}, 6),
                                       mpu=parallel_state_sp)
    config.heterogeneous.coordinate(config)
    return {"world": config.world_size, "dp_rank": config.heterogeneous.dp_rank,
            "plan": list(config.heterogeneous.plan.micro_batch_sizes), "mbs": config.train_micro_batch_size_per_gpu}


def _mesh_loader(rank):
    """A (data 1 x sequence 2) device mesh: one replica, so the loader is data-parallel rank 0's on
    both ranks (upstream's deepspeed_io would take the global rank)."""
    import deepspeed

    model = _model()
    config = _config({"load_balancing_strategy": "uniform"}, 6, data_parallel_size=1, sequence_parallel_size=2)
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=_dataset())
    return {"dp_rank": engine.heterogeneous_state.dp_rank, "sampler_rank": loader.batch_sampler.rank,
            "plan": list(engine.heterogeneous_plan.micro_batch_sizes)}


def _case(rank, world_size, kind, **kwargs):
    from deepspeed.runtime.heterogeneous.cluster import agreement

    # Each case starts from a round of settings checks of its own, the same on both ranks, whatever
    # an earlier case that enabled the fork on one rank only left behind (a real job ends there).
    agreement._rounds = 1000 * kwargs.pop("round")
    return {"own_device": _own_device, "settings": _settings, "pipeline": _pipeline,
            "sequence_parallel": _sequence_parallel_mpu, "mesh": _mesh_loader,
            "new_group": _new_default_group}[kind](rank, **kwargs)


SETTINGS_ON = [{}, {}]
COMPUTE_AWARE = {"load_balancing_strategy": "compute_aware"}
CASES = [
    # 0-3: each rank describes its own device.
    dict(kind="own_device", memory_gib=[80, 16], heterogeneous=COMPUTE_AWARE),
    dict(kind="own_device", memory_gib=[80, 16], train_batch_size=8,
         heterogeneous={"load_balancing_strategy": "manual", "micro_batch_sizes": {H100: 5, V100: 3}}),
    # 2-3: start-up priors within memory: the devices' own, then emulated capacities.
    dict(kind="own_device", memory_gib=[16, 16], heterogeneous=COMPUTE_AWARE),
    dict(kind="own_device", memory_gib=[80, 16],
         heterogeneous={**COMPUTE_AWARE, "emulation": {"memory_gb": [1, 1]}}),
    # 4-8: settings that differ between the ranks.
    dict(kind="settings", env=SETTINGS_ON, heterogeneous=[{}, {}]),
    dict(kind="settings", env=[{}, {"DS_ADAPTIVE_SCHEDULING": "true"}], heterogeneous=[{}, {}]),
    dict(kind="settings", env=SETTINGS_ON, heterogeneous=[{"profile_steps": 3}, {"profile_steps": 5}]),
    dict(kind="settings", env=[{"DS_HETEROGENEOUS_ENV": "1"}, {}], heterogeneous=None, config_block=False),
    dict(kind="settings", env=[{}, {"DS_HETEROGENEOUS_ENV": "1"}], heterogeneous=None, config_block=False),
    # 9: a PipelineModule (one stage, two replicas) starts; pipelines are tested in test_pipeline.py.
    dict(kind="pipeline"),
    # 10: the data-parallel rank under sequence parallelism.
    dict(kind="sequence_parallel"),
    # 11: a config on a new default process group.
    dict(kind="new_group"),
    # 12: the data-parallel rank under a mesh (the mesh stays in groups: last).
    dict(kind="mesh"),
]
for _number, _case_params in enumerate(CASES):
    _case_params["round"] = _number + 1


@pytest.fixture(scope="module")
def results():
    return run_subcases(_case, CASES, world_size=2, timeout=420)


@pytest.mark.multiprocess
def test_each_rank_describes_its_own_device_on_a_multi_device_host(results):
    # Rank 1 is LOCAL_RANK 1: device 1, the V100, with its own 16 GiB (not device 0's).
    for ranks in results[0:4]:
        for result in ranks:
            assert result["names"] == [H100, V100], result
    assert results[0][0]["memory"] == [80 * GIB, 16 * GIB]
    # The datasheet priors (989 vs 125 TFLOP/s) give the H100 an 8:1 share, [16, 2]; until the
    # first step measures activations, each rank holds at most its room's proportion of the
    # micro-step, 80:16 GiB (15:3), and the priors' plan stays the reference profiling returns to.
    assert [r["plan"] for r in results[0]] == [[15, 3], [15, 3]]
    assert [(r["mbs"], r["fed"]) for r in results[0]] == [(15, 15), (3, 3)]
    # Manual sizes by device name reach the rank whose device has that name.
    assert [(r["plan"], r["mbs"], r["fed"]) for r in results[1]] == [([5, 3], 5, 5), ([5, 3], 3, 3)]


@pytest.mark.multiprocess
def test_start_up_priors_stay_within_memory(results):
    # Equal memory (the devices' own, then emulated): before any activation is measured, no rank is
    # asked to hold more than an equal share of a micro-step (9), whatever its speed, and the first
    # step keeps one gas for every rank, whatever loop feeds it ([9, 9] rather than the 8:1 [16, 2]).
    for case in (results[2], results[3]):
        for rank, result in enumerate(case):
            assert all(size <= 9 for size in result["plan"]), result
            assert sum(m * g for m, g in zip(result["plan"], result["gas"])) == 18, result
            assert any("start-up memory limits" in note for note in result["notes"]), result
            assert result["fed"] == result["mbs"] == result["plan"][rank]


@pytest.mark.multiprocess
def test_every_rank_must_run_the_same_settings(results):
    agree, env, block, on_rank0_only, on_rank1_only = results[4:9]
    assert agree == [{"enabled": True, "error": None}] * 2
    for result in env:
        assert "DS_ADAPTIVE_SCHEDULING is unset on ranks [0] and 'true' on ranks [1]" in result["error"], result
        assert "heterogeneous_config.scheduler.dynamic_rebalancing is false on ranks [0] and true on ranks [1]" \
            in result["error"], result
        assert "srun and torchrun do not forward them" in result["error"], result
    assert env[0]["error"] == env[1]["error"]
    for result in block:
        assert "heterogeneous_config.profile_steps is 3 on ranks [0] and 5 on ranks [1]" in result["error"], result
    # The fork enabled on one rank only (an environment variable set on one node): the rank that has
    # it ends in an error naming the other instead of hanging; the other never runs the fork's code.
    assert on_rank0_only[1] == {"enabled": False, "error": None}
    assert "global ranks [1] did not report their heterogeneous settings" in on_rank0_only[0]["error"]
    assert "DS_HETEROGENEOUS_ENV is '1'" in on_rank0_only[0]["error"]
    assert on_rank1_only[0] == {"enabled": False, "error": None}
    assert "global rank 0 did not check the ranks' heterogeneous settings" in on_rank1_only[1]["error"]


@pytest.mark.multiprocess
def test_a_pipeline_module_starts(results):
    assert results[9] == [None, None], results[9]


@pytest.mark.multiprocess
def test_data_parallel_rank_follows_the_gradient_groups(results):
    # Ulysses: the two ranks split one replica's sequences: one data-parallel rank, 0, for both.
    assert [r["dp_rank"] for r in results[10]] == [0, 0]
    assert [(r["world"], r["plan"], r["mbs"]) for r in results[10]] == [(1, [6], 6)] * 2
    # A (1 x 2) mesh: the same, and the training loader takes the plan's rank, not the global one.
    assert results[12] == [{"dp_rank": 0, "sampler_rank": 0, "plan": [6]}] * 2


@pytest.mark.multiprocess
def test_a_new_default_group_runs_the_start_up_agreement_on_every_rank(results):
    """The start-up collectives' cache knows a new default group by identity, not by ``id()``,
    which CPython may reuse on some ranks only (rank 1 here): those would skip the settings
    agreement their peers run and leave them waiting."""
    assert results[11] == [1, 1], results[11]
