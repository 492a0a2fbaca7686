# SPDX-License-Identifier: Apache-2.0
"""Checkpoints that cannot be mixed up (deepspeed/runtime/heterogeneous/elastic/).

- A tag saved on 3 ranks and resumed on 2 (converted to a universal checkpoint), then saved again
  under the same name from another initialisation and resumed on 2 again, loads the new contents:
  the conversion records the files it was made from and is redone when they changed.
- SGD's state is not what the universal checkpoint carries: a load onto another world is refused by
  name before anything is converted.
- A periodic save goes to a temporary tag, renamed once every rank has written it, replacing an
  earlier save of the name; a killed conversion's work folder is removed on the next load.
"""

import os
import time

import pytest
import torch

from harness import run_subcases
from test_elastic import BATCH, LR, SAVE_AT, STEPS, _steps, elastic_config, make_model, recording_dataset
from references import adam_mse_reference


def _run(rank, world_size, folder, save=False, load=False, shift=0.0, optimizer=None):
    """ZeRO-2: steps 1..STEPS saving at SAVE_AT under the tag ``step3`` (``save``), or from that tag to
    STEPS (``load``). ``shift`` moves the initial parameters (another initialisation); ``optimizer``
    replaces Adam. Returns each step's fed indices, the initial and the final fp32 parameters."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    config = elastic_config(world_size, 2)
    if optimizer is not None:
        config.update(optimizer=optimizer, zero_allow_untested_optimizer=True)
    dataset = recording_dataset()
    model = make_model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(shift)
    initial = [p.detach().clone() for p in model.parameters()]
    engine, _, loader, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                training_data=dataset)
    if load:
        try:
            engine.load_checkpoint(folder, tag="step3")
        except Exception as error:  # the parent checks the message
            return {"error": f"{type(error).__name__}: {error}"}
    fed, iterator = [], iter(loader)
    for _ in range(engine.global_steps, STEPS):
        start = len(dataset.seen)
        inputs, targets = next(iterator)
        engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
        engine.step()
        fed.append(dataset.seen[start:])
        if save and engine.global_steps == SAVE_AT:
            engine.save_checkpoint(folder, tag="step3")
    return {"fed": fed, "initial": initial,
            "params": [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]}


def _reference(saved):
    """Adam on what the 3 ranks fed, from their initial parameters."""
    model = make_model()
    with torch.no_grad():
        for param, start in zip(model.parameters(), saved[0]["initial"]):
            param.copy_(start)
    dataset = recording_dataset()
    return adam_mse_reference(model, dataset.inputs, dataset.targets, _steps(saved), LR)


@pytest.mark.multiprocess
def test_a_tag_saved_again_loads_its_new_contents_on_another_world(tmp_path):
    folder = str(tmp_path / "ckpt")
    (first, ) = run_subcases(_run, [dict(folder=folder, save=True)], world_size=3, timeout=600)
    (resumed_first, ) = run_subcases(_run, [dict(folder=folder, load=True)], world_size=2, timeout=600)
    done = os.path.join(folder, "step3.universal", "deepspeed_hetero_conversion.json")
    converted_at = os.stat(done).st_mtime_ns
    # The same name again, other contents (another initialisation), then the same load.
    (second, ) = run_subcases(_run, [dict(folder=folder, save=True, shift=0.05)], world_size=3, timeout=600)
    (resumed_second, ) = run_subcases(_run, [dict(folder=folder, load=True)], world_size=2, timeout=600)
    assert os.stat(done).st_mtime_ns != converted_at, "the stale conversion was reused"
    for saved, resumed in ((first, resumed_first), (second, resumed_second)):
        assert _steps(resumed) == _steps(saved)[SAVE_AT:]
        for rank_result in resumed:
            for got, want in zip(rank_result["params"], saved[0]["params"]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for got, want in zip(saved[0]["params"], _reference(saved)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # The two runs differ, so the second resume could not have passed on the first one's state.
    assert max((a - b).abs().max().item() for a, b in zip(first[0]["params"], second[0]["params"])) > 1e-2


@pytest.mark.multiprocess
def test_sgd_state_is_refused_by_name_before_any_conversion(tmp_path):
    folder = str(tmp_path / "sgd")
    sgd = {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}}
    run_subcases(_run, [dict(folder=folder, save=True, optimizer=sgd)], world_size=3, timeout=600)
    (refused, ) = run_subcases(_run, [dict(folder=folder, load=True, optimizer=sgd)], world_size=2, timeout=600)
    for rank_result in refused:
        error = rank_result.get("error", "")
        assert "re-partitioning it is not supported for the optimizer SGD" in error, rank_result
        assert "momentum_buffer" in error, error
    assert not os.path.exists(os.path.join(folder, "step3.universal"))


def test_a_killed_conversions_work_folder_is_removed_and_a_live_ones_kept(tmp_path):
    from deepspeed.runtime.heterogeneous.elastic.resize import PARTIAL_INFIX, remove_abandoned_work
    target = str(tmp_path / "step3.universal")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    abandoned, live = f"{target}{PARTIAL_INFIX}{dead}", f"{target}{PARTIAL_INFIX}{os.getpid()}"
    for work in (abandoned, live):
        os.makedirs(os.path.join(work, "universal"))
    remove_abandoned_work(target)
    assert not os.path.exists(abandoned) and os.path.exists(live)


def test_a_conversion_is_current_only_for_the_files_it_was_made_from(tmp_path):
    from deepspeed.runtime.heterogeneous.elastic.resize import source_listing
    tag = tmp_path / "step3"
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"a" * 10)
    before = source_listing(str(tag))
    assert source_listing(str(tag)) == before
    time.sleep(0.01)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"b" * 10)  # same size, saved again
    assert source_listing(str(tag)) != before
    (tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"c")
    assert len(source_listing(str(tag))) == 2


def test_a_periodic_save_replaces_the_tag_it_renames_onto(tmp_path):
    from deepspeed.runtime.heterogeneous.elastic.periodic import PARTIAL_SUFFIX, publish_tag
    old = tmp_path / "global_step4"
    old.mkdir()
    (old / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_text("a rank that is gone")
    (tmp_path / "global_step4.universal").mkdir()
    new = tmp_path / f"global_step4{PARTIAL_SUFFIX}"
    new.mkdir()
    (new / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_text("new")
    publish_tag(str(tmp_path), new.name, "global_step4")
    assert sorted(os.listdir(tmp_path)) == ["global_step4"]
    assert os.listdir(old) == ["zero_pp_rank_0_mp_rank_00_optim_states.pt"]
