# SPDX-License-Identifier: Apache-2.0
"""Faults around checkpoints: a rank killed while it writes, files truncated or overwritten, a rank
killed inside a collective (deepspeed/runtime/heterogeneous/elastic/integrity.py and
patches/engine-checkpoint-latest-after-every-rank.patch). Two CPU ranks under the real deepspeed
launcher, ZeRO-2 with the heterogeneous plan [6, 2] and shares [0.7, 0.3]
(tests/unit/scripts/checkpoint_faults.py); collectives time out after 60 s.

- A rank killed halfway through its optimizer file inside ``save_checkpoint``: the job ends, the
  launcher names the killed rank, ``latest`` still names the previous complete tag, and a plain
  ``load_checkpoint(dir)`` in a new job loads it exactly: the parameters equal the saving run's at
  that step, and one more step equals its next step (the optimizer state and the samplers too).
- That torn tag, with another of its files overwritten in a record's middle: loading it stops every
  rank with one line that names both files and what is wrong with each, and no traceback.
- A rank killed as it enters the gradients' reduction, each rank under its own launcher (two hosts,
  as ``deepspeed --no_ssh`` starts them): the survivor stops by itself with the broken collective's
  message.
- What each kind of damage reads as, without processes.
"""

import os
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from harness import (REPO_ROOT, clear_stale_build_locks, deepspeed_launcher, fork_environment, free_port,
                     launch_deepspeed, remove_shm_buffers)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "checkpoint_faults.py"
TIMEOUT = 240
OPTIMIZER_FILE = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def _overwrite_inside_a_record(path, count=64):
    """Overwrite ``count`` bytes in the middle of the largest record of the zip archive at ``path``
    (tensor data, which torch reads back without noticing); returns the record's name."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.compress_size)
    with open(path, "r+b") as stream:
        stream.seek(record.header_offset + 26)
        name_length, extra_length = int.from_bytes(stream.read(2), "little"), int.from_bytes(stream.read(2), "little")
        stream.seek(record.header_offset + 30 + name_length + extra_length + record.compress_size // 2)
        original = stream.read(count)
        stream.seek(-count, os.SEEK_CUR)
        stream.write(bytes(255 - b for b in original))
    return record.filename


@pytest.mark.multiprocess
def test_a_save_killed_midway_is_never_loaded_and_a_damaged_tag_is_named_on_one_line(tmp_path):
    code, output = launch_deepspeed(SCRIPT, ["--out", tmp_path, "--case", "kill-in-save"], timeout=TIMEOUT)
    assert code != 0, output[-4000:]
    killed = [line for line in output.splitlines() if "exits with return code = -9" in line]
    assert len(killed) == 1 and "--local_rank=1" in killed[0], output[-4000:]
    explicit = tmp_path / "explicit"
    assert (explicit / "latest").read_text() == "step2", "latest names the tag a rank was killed writing"
    torn, overwritten = explicit / "step4" / OPTIMIZER_FILE.format(1), explicit / "step4" / OPTIMIZER_FILE.format(0)
    assert 0 < torn.stat().st_size < (explicit / "step2" / OPTIMIZER_FILE.format(1)).stat().st_size
    record = _overwrite_inside_a_record(overwritten)

    code, output = launch_deepspeed(SCRIPT, ["--out", tmp_path, "--case", "load", "--load", explicit, "--load",
                                             f"{explicit}:step4"], timeout=TIMEOUT)
    assert code != 0, output[-4000:]
    lines = [line for line in output.splitlines() if "CheckpointFileError" in line]
    assert len(lines) == 1, output[-4000:]
    assert lines[0].startswith("CheckpointFileError: deepspeed-hetero: load_checkpoint: cannot load the checkpoint "
                               f"{explicit / 'step4'}, nothing was loaded: "), lines[0]
    assert f"{torn} is truncated (" in lines[0], lines[0]
    assert f"{overwritten} is corrupted (its record '{record}' differs from what was written" in lines[0], lines[0]
    assert "Traceback" not in output, output[-4000:]

    (loaded, ) = torch.load(tmp_path / "loaded.pt")
    reference = torch.load(tmp_path / "reference.pt")
    assert loaded["path"] == str(explicit / "step2" / "mp_rank_00_model_states.pt") and loaded["steps"] == 2
    for got, want in ((loaded["params"], reference["step2"]), (loaded["params_after_step"], reference["step3"])):
        assert len(got) == len(want) == 4
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The checks compare different states: the step moved every parameter.
    assert all(not torch.equal(a, b) for a, b in zip(reference["step2"], reference["step3"]))


def _launch_as_two_hosts(out, timeout=TIMEOUT):
    """The script's ``kill-in-step`` case with each rank under a launcher of its own, as on two hosts
    (``deepspeed --hostfile H --no_ssh --node_rank K``): no launcher ends the survivor for it.
    Returns ``[(returncode, output)]`` by host."""
    hostfile = out / "hostfile"
    hostfile.write_text("hostA slots=1\nhostB slots=1\n")
    port = free_port()
    env = {**os.environ, **fork_environment(), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    clear_stale_build_locks(env.get("TORCH_EXTENSIONS_DIR"))
    hosts = [
        subprocess.Popen([deepspeed_launcher(), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
                          "--master_addr", "127.0.0.1", "--master_port", str(port), str(SCRIPT), "--out", str(out),
                          "--case", "kill-in-step"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True) for node in (0, 1)
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for host in hosts:
            try:
                output, _ = host.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a host's launcher did not finish within {timeout} s (killed)") from None
            results.append((host.returncode, output))
    finally:
        for host in hosts:
            try:
                os.killpg(host.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
        remove_shm_buffers(port)
    return results


@pytest.mark.multiprocess
def test_a_rank_killed_inside_a_collective_stops_its_peer_on_another_host(tmp_path):
    (survivor_code, survivor), (killed_code, killed) = _launch_as_two_hosts(tmp_path)
    assert killed_code != 0 and "exits with return code = -9" in killed, killed[-4000:]
    assert survivor_code != 0, survivor[-4000:]
    # The survivor was inside the reduction when its peer died and stopped as the connection broke,
    # not after the collectives' 60 s time-out ("Timed out").
    assert "Connection reset by peer" in survivor or "Connection closed by peer" in survivor, survivor[-4000:]


def _saved(path, **tensors):
    torch.save(tensors, path)
    return path


def test_each_kind_of_damage_is_named(tmp_path):
    from deepspeed.runtime.heterogeneous.elastic.integrity import damaged_message, file_problem
    whole = _saved(tmp_path / "whole.pt", weights=torch.arange(4096.0), moments=torch.ones(4096))
    assert file_problem(whole) is None

    data = whole.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[:len(data) // 2])
    assert file_problem(tmp_path / "truncated.pt").startswith(
        f"is truncated ({len(data) // 2} bytes, without the zip directory torch.save writes at its end")

    corrupted = tmp_path / "corrupted.pt"
    corrupted.write_bytes(data)
    record = _overwrite_inside_a_record(corrupted)
    torch.load(corrupted)  # torch itself notices nothing
    assert file_problem(corrupted).startswith(f"is corrupted (its record '{record}' differs from what was written")

    (tmp_path / "empty.pt").write_bytes(b"")
    assert file_problem(tmp_path / "empty.pt").startswith("is empty (0 bytes")
    assert file_problem(tmp_path / "absent.pt") == "is missing"
    (tmp_path / "text.pt").write_text("not a checkpoint")
    assert file_problem(tmp_path / "text.pt") == "is not a file torch.save writes (it begins with the bytes 6e6f7420)"

    legacy = tmp_path / "legacy.pt"
    torch.save({"weights": torch.ones(8)}, legacy, _use_new_zipfile_serialization=False)
    assert file_problem(legacy) is None
    legacy.write_bytes(legacy.read_bytes()[:40])
    assert file_problem(legacy).startswith("does not unpickle (")

    message = damaged_message("/ckpt/step4", {"/ckpt/step4/a.pt": "is missing", "/ckpt/step4/b.pt": "is empty"})
    assert message == ("deepspeed-hetero: load_checkpoint: cannot load the checkpoint /ckpt/step4, nothing was "
                       "loaded: /ckpt/step4/a.pt is missing; /ckpt/step4/b.pt is empty. Load another tag "
                       "(engine.load_checkpoint(dir, tag=...)) or save it again")


def test_a_file_saved_without_checksums_is_still_found_truncated(tmp_path):
    from torch.utils.serialization import config
    from deepspeed.runtime.heterogeneous.elastic.integrity import file_problem
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        plain = _saved(tmp_path / "plain.pt", weights=torch.arange(4096.0))
    finally:
        config.save.compute_crc32 = before
    assert file_problem(plain) is None
    _overwrite_inside_a_record(plain)
    assert file_problem(plain) is None, "no CRC-32 recorded: an overwritten record cannot be told"
    data = plain.read_bytes()
    plain.write_bytes(data[:len(data) - 100])
    assert file_problem(plain).startswith("is truncated (")


def test_the_save_order_publishes_latest_after_every_rank(tmp_path):
    """``publish_latest`` writes ``latest`` in one rename, on global rank 0 only, and waits for every
    rank after it; nothing without ``save_latest`` or with the decoupled writer."""
    from types import SimpleNamespace
    from unittest import mock
    from deepspeed.runtime.heterogeneous.elastic import integrity

    def engine(rank, decoupled=False):
        return SimpleNamespace(global_rank=rank, checkpoint_engine=SimpleNamespace(is_decoupled=lambda: decoupled))

    with mock.patch.object(integrity.dist, "barrier") as barrier:
        integrity.publish_latest(engine(1), str(tmp_path), "step2", True)
        assert not (tmp_path / "latest").exists() and barrier.call_count == 1
        integrity.publish_latest(engine(0), str(tmp_path), "step2", True)
        assert (tmp_path / "latest").read_text() == "step2" and barrier.call_count == 2
        integrity.publish_latest(engine(0), str(tmp_path), "step4", False)
        integrity.publish_latest(engine(0, decoupled=True), str(tmp_path), "step4", True)
        assert (tmp_path / "latest").read_text() == "step2" and barrier.call_count == 2
    assert sorted(os.listdir(tmp_path)) == ["latest"]
