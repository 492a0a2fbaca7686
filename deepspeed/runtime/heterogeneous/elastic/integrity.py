# SPDX-License-Identifier: Apache-2.0
"""Checkpoints that are complete or not used: ``latest`` names a tag once every rank wrote it, and
a load reads no file that is not as it was written.

Saving. Upstream's ``save_checkpoint`` has global rank 0 write ``latest`` as soon as rank 0's own
files are written, before the barrier that waits for the other ranks'. A rank killed while writing
its optimizer file then leaves ``latest`` naming a torn tag, and the next plain
``load_checkpoint(dir)`` reads it (measured: a rank SIGKILLed halfway through its file, ``latest``
named that tag). ``publish_latest`` (called at the end of ``save_checkpoint``,
``engine-checkpoint-latest-after-every-rank.patch``) writes ``latest`` after that barrier, in one
rename (``write_latest``), then waits once more so that every rank sees it when
``save_checkpoint`` returns, as upstream's order guaranteed. A save killed midway leaves
``latest`` naming the previous complete tag.

Loading. torch reads a truncated file with ``OSError: [Errno 22] Invalid argument`` (or
``PytorchStreamReader failed reading zip archive``), naming no file, on the rank that reads it only,
while its peers go on into their next collective; and it reads a file whose bytes were overwritten
without a word when they are tensor data (measured: a ZeRO-2 optimizer file with 64 bytes
overwritten loaded, the Adam state silently changed). ``check_tag`` (called by
``elastic/resize.prepare_load``, before upstream reads anything) has every rank check the files
this load will read on it (``damaged_files_read_here``): each must exist and read back as written.
``torch.save`` writes a zip archive with a CRC-32 per record, so a truncated file lacks the
archive's directory (at its end) and an overwritten record fails its CRC. The verdicts are
gathered, and every rank raises the same ``CheckpointFileError``, which names each damaged file and
what is wrong with it: the fork's exception hook prints it once, on one line.

Costs one more read of the files a rank loads (from the page cache when it follows the save).
A file saved with ``torch.utils.serialization.config.save.compute_crc32 = False`` records no
CRC-32: its truncation is found, an overwritten record is not. Not checked: a pipeline engine's
layer files, MoE expert files, NVMe swap files, and a load of the user's own universal checkpoint.
"""

import glob
import os
import re
import struct
import zipfile
import zlib

import torch

from deepspeed import comm as dist

READ_CHUNK = 16 << 20
ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip record's local header: 30 bytes before its name
_OPTIMIZER_FILE = re.compile(r"zero_pp_rank_\d+_mp_rank_(\d+)_optim_states\.pt$")


class CheckpointFileError(RuntimeError):
    """A checkpoint whose files are missing, truncated or corrupted; raised alike on every rank."""


def publish_latest(engine, save_dir, tag, save_latest):
    """``save_checkpoint``'s last step, after the barrier that follows every rank's files: global
    rank 0 points ``<save_dir>/latest`` at ``tag``, then every rank waits for it. Nothing when
    ``save_latest`` is off or the decoupled writer commits later (upstream then writes ``latest`` in
    its commit). With or without the fork: the order is a fix of upstream's."""
    if not save_latest or engine.checkpoint_engine.is_decoupled():
        return
    if engine.global_rank == 0:
        write_latest(save_dir, tag)
    dist.barrier()


def write_latest(folder, tag):
    """``<folder>/latest`` names ``tag``, replaced in one rename."""
    partial = os.path.join(folder, f".latest.partial-{os.getpid()}")
    with open(partial, "w") as stream:
        stream.write(tag)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, os.path.join(folder, "latest"))


def check_tag(engine, agreement, load_dir, tag, load_optimizer_states=True, load_module_only=False):
    """Raise ``CheckpointFileError`` on every rank when a file the load will read on any rank is
    missing or not as written (the module docstring). Every rank calls it with the same arguments;
    one gather."""
    mine = damaged_files_read_here(engine, load_dir, tag, load_optimizer_states, load_module_only)
    everyone = agreement.gather_from_every_rank(mine, "the verdicts on the checkpoint's files")
    damaged = dict(sorted(item for entries in everyone for item in entries.items()))
    if damaged:
        raise CheckpointFileError(damaged_message(os.path.join(load_dir, str(tag)), damaged))


def damaged_files_read_here(engine, load_dir, tag, load_optimizer_states=True, load_module_only=False):
    """{path: problem} of the files upstream's ``load_checkpoint`` reads on this rank, by upstream's
    own names: data-parallel rank 0's model states (every rank reads them; they say how many
    data-parallel ranks saved the tag) and, on a rank the tag has files of, its own model states
    (ZeRO-3) and, loading a ZeRO optimizer's state, its own optimizer file (every rank's with
    ZeRO's ``elastic_checkpoint``). A rank beyond the saving world reads a converted form instead:
    a load onto another world reads every file of the tag in ``resize.convert``, which checks them."""
    folder = os.path.join(load_dir, str(tag))
    first = sorted(glob.glob(engine._get_ckpt_name(load_dir, tag, mp_placeholder="*", pp_placeholder="0")))
    damaged = damaged_files(first or [engine._get_ckpt_name(load_dir, tag, pp_placeholder="0")])
    group = getattr(engine.optimizer, "dp_process_group", None)
    if damaged or not engine.zero_optimization() or group is None:
        return damaged
    try:
        saved_world = _saved_world(first[0])
    except Exception as exc:  # noqa: BLE001 -- intact as a zip archive, yet torch cannot read it
        return {first[0]: f"does not unpickle ({type(exc).__name__}: {exc})"}
    if saved_world is not None and dist.get_rank(group=group) >= saved_world:
        return damaged
    files = []
    if engine.zero_optimization_partition_weights():
        files += engine._get_all_ckpt_names(load_dir, tag) or [engine._get_ckpt_name(load_dir, tag)]
    if load_optimizer_states and not load_module_only and not engine.zero_nvme_offload_optimizer():
        if engine.zero_elastic_checkpoint():
            names = sorted(os.listdir(folder))
            files += [os.path.join(folder, name) for name in names for match in [_OPTIMIZER_FILE.search(name)]
                      if match and int(match.group(1)) == engine.checkpoint_mp_rank]
        else:
            own = engine._get_zero_ckpt_name(load_dir, tag)
            legacy = own.replace("_optim_states.pt", "optim_states.pt")  # upstream reads this older name too
            files.append(legacy if not os.path.exists(own) and os.path.exists(legacy) else own)
    return damaged_files(dict.fromkeys(file for file in files if file not in first))


def _saved_world(model_file):
    """The data-parallel world a model-states file was saved by (None where it does not say)."""
    try:
        saved = torch.load(model_file, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:  # torch's legacy format cannot be memory-mapped
        saved = torch.load(model_file, map_location="cpu", weights_only=False)
    world = saved.get("dp_world_size") if isinstance(saved, dict) else None
    return None if world is None else int(world)


def damaged_files(paths):
    """{path: problem} of the files among ``paths`` that are missing or not as written."""
    return {path: problem for path in paths for problem in [file_problem(path)] if problem is not None}


def tag_files(folder):
    """Every torch file of a tag (what upstream's converter reads), sorted."""
    return sorted(os.path.join(root, name) for root, _, names in os.walk(folder) for name in names
                  if name.endswith(".pt"))


def damaged_message(folder, damaged):
    """One line: the tag and each damaged file (``damaged``: {path: problem}) with what is wrong."""
    files = "; ".join(f"{path} {problem}" for path, problem in damaged.items())
    return (f"deepspeed-hetero: load_checkpoint: cannot load the checkpoint {folder}, nothing was loaded: {files}. "
            f"Load another tag (engine.load_checkpoint(dir, tag=...)) or save it again")


def file_problem(path):
    """What is wrong with the file at ``path`` ("is truncated (...)", ...), or None when it reads
    back as ``torch.save`` wrote it."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as stream:
            head = stream.read(len(ZIP_MAGIC))
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size == 0:
        return "is empty (0 bytes: its writer stopped before it wrote anything)"
    if head == ZIP_MAGIC:
        return _archive_problem(path, size)
    if head[:1] == b"\x80":  # a pickle: torch's legacy format, which has no checksums
        return _legacy_problem(path)
    return f"is not a file torch.save writes (it begins with the bytes {head.hex()})"


def _archive_problem(path, size):
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        return (f"is truncated ({size} bytes, without the zip directory torch.save writes at its end: the "
                f"process writing it stopped before it finished)")
    with archive, open(path, "rb") as stream:
        for record in archive.infolist():
            try:
                crc = _record_crc(archive, record, stream)
            except (zipfile.BadZipFile, EOFError, OSError, ValueError, zlib.error) as exc:
                return f"is truncated or corrupted (its record {record.filename!r} cannot be read: {exc})"
            if crc is not None and record.CRC and crc != record.CRC:
                return (f"is corrupted (its record {record.filename!r} differs from what was written: CRC-32 "
                        f"{crc:08x}, recorded {record.CRC:08x})")
    return None


def _record_crc(archive, record, stream):
    """The CRC-32 of ``record``'s bytes as they are on disk; None where zipfile checked them itself."""
    if record.compress_type != zipfile.ZIP_STORED:  # torch stores; zipfile's reader checks others' CRC
        with archive.open(record) as data:
            while data.read(READ_CHUNK):
                pass
        return None
    stream.seek(record.header_offset)
    header = stream.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or not header.startswith(ZIP_MAGIC):
        raise zipfile.BadZipFile("its header is overwritten or missing")
    name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
    stream.seek(record.header_offset + _LOCAL_HEADER.size + name_length + extra_length)
    crc, left = 0, record.compress_size
    while left > 0:
        chunk = stream.read(min(left, READ_CHUNK))
        if not chunk:
            raise EOFError(f"the file ends {left} bytes before the record's end")
        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    return crc


def _legacy_problem(path):
    try:
        torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 -- whatever the unpickler raises is the problem
        return f"does not unpickle ({type(exc).__name__}: {exc})"
    return None
