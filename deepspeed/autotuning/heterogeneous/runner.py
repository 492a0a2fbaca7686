# SPDX-License-Identifier: Apache-2.0
"""Run one experiment: the ``deepspeed`` launcher in its own process group, with a time-out.

Each experiment is the user's command line launched again through DeepSpeed's own runner with
the same resources: on one node that is the local launcher (no pdsh, no ssh), on several nodes
the launcher the user chose. The launcher and every rank it starts share a new session; when the
experiment ends, times out or the tuner is interrupted, the whole group is killed, so no rank is
left behind. Time the experiment's own processes spend JIT-building ops does not count towards
its time-out. A rank killed while it builds leaves torch's build lock, on which every later run
would wait forever: the locks created during a killed experiment that no process holds are
removed, and a time-out names older ones.
"""

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

from deepspeed.ops.op_builder.jit_announce import lock_holders
from .results import OK, classify
from .settings import BATCH, GAS, MBS, NUM_STAGES, AutotuningConfigError

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_config_path(user_args):
    """The ds_config file the user's script is given, or None."""
    for i, arg in enumerate(user_args):
        for flag in CONFIG_FLAGS:
            if (arg == flag and i + 1 < len(user_args) and user_args[i + 1].endswith(".json")
                    and not user_args[i + 1].startswith("-")):
                return user_args[i + 1]
            if arg.startswith(flag + "=") and arg.endswith(".json"):
                return arg.split("=", 1)[1]
    return None


def experiment_args(user_args, config_path, arg_mappings, experiment):
    """The user's arguments with the experiment's ds_config and the mapped flags' values."""
    args = list(user_args)
    replaced = False
    for i, arg in enumerate(args):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(args) and args[i + 1].endswith(".json") and not args[i + 1].startswith("-"):
                args[i + 1] = config_path
                replaced = True
            elif arg.startswith(flag + "=") and arg.endswith(".json"):
                args[i] = f"{flag}={config_path}"
                replaced = True
    if not replaced:
        raise AutotuningConfigError("the script's arguments do not name a ds_config: pass it as --deepspeed_config "
                                    "FILE.json (or --deepspeed FILE.json) so every experiment can replace it")
    # One value per flag for all ranks: with per-rank micro-batches a mapped micro-batch flag gets
    # the largest (the engine's heterogeneous sampler sizes each rank's batches itself).
    values = {MBS: max(experiment.micro_batch_sizes), GAS: experiment.gas, BATCH: experiment.train_batch_size,
              NUM_STAGES: experiment.pipeline_stages}
    for key, flag in arg_mappings.items():
        if values[key] is None:
            continue  # no pipeline tuned: the script keeps its own degree
        value = str(values[key])
        if flag in args:
            index = args.index(flag)
            if index + 1 < len(args):
                args[index + 1] = value
                continue
        prefixed = [i for i, arg in enumerate(args) if arg.startswith(flag + "=")]
        if prefixed:
            args[prefixed[0]] = f"{flag}={value}"
        else:
            args += [flag, value]
    return args


def kill_group(process, grace=10.0):
    """SIGTERM the experiment's process group, then SIGKILL whatever is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if process.poll() is not None and not _group_alive(process.pid):
            return
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5.0  # SIGKILLed members go within moments; their locks are judged after
    while _group_alive(process.pid) and time.monotonic() < deadline:
        process.poll()
        time.sleep(0.05)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def extension_roots(env):
    """Where the experiment's ranks JIT-build ops: TORCH_EXTENSIONS_DIR, else torch's default root."""
    explicit = env.get("TORCH_EXTENSIONS_DIR")
    if explicit:
        return [explicit]
    from torch.utils.cpp_extension import get_default_build_root
    return [get_default_build_root()]


BUILD_ALLOWANCE_S = 3600.0
"""At most this long spent JIT-building ops is left out of an experiment's time-out."""

POLL_S = 1.0


def build_locks(roots, since=None):
    """torch JIT build locks (``<root>/<op>/lock``, or one level deeper under the default root),
    only those created at or after ``since`` (seconds since the epoch) when given."""
    found = []
    for root in roots:
        paths = glob.glob(os.path.join(root, "*", "lock")) + glob.glob(os.path.join(root, "*", "*", "lock"))
        for path in sorted(set(paths)):
            try:
                # One second of slack for file systems with coarse time stamps.
                if since is None or os.stat(path).st_mtime >= since - 1.0:
                    found.append(path)
            except OSError:
                pass
    return found


def _in_group(pid, pgid):
    try:
        return os.getpgid(pid) == pgid
    except OSError:
        return False


def orphaned_build_locks(roots, since=None):
    """Build locks that no process holds, only those created at or after ``since`` when given
    (None where this system cannot tell a dead owner from a live one)."""
    paths = build_locks(roots, since)
    holders = lock_holders(paths)
    return None if holders is None else [path for path in paths if not holders[path]]


def remove_build_locks(roots, since):
    """Remove the build locks created at or after ``since`` that no process holds; returns their
    paths. Called once the experiment's process group is gone: such a lock was left by one of its
    ranks, killed mid-build, and torch's lock names no owner, so a later load would wait on it
    forever. A lock held by a live process (another job building the same op) is left alone.
    """
    removed = []
    for path in orphaned_build_locks(roots, since) or []:
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


def remove_shm_buffers(port):
    """Remove the CPU all-reduce's shared-memory buffers of a launch on ``port``: the fork unlinks
    them once every rank has mapped them, but a rank killed before that (a timed-out or failed
    experiment) leaves its own."""
    for path in glob.glob(f"{SHM_BUFFERS[:-1]}*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def mapped_paths(proc="/proc"):
    """Every path some live process maps (``/proc/<pid>/maps``), as far as this process may read."""
    paths = set()
    for maps in glob.glob(os.path.join(proc, "[0-9]*", "maps")):
        try:
            with open(maps) as handle:
                paths.update(line.split(None, 5)[5].strip() for line in handle if line.count(" ") >= 5
                             and "/dev/shm/" in line)
        except (OSError, IndexError):
            pass
    return paths


def remove_orphaned_shm_buffers(min_age_s=60.0, now=None, mapped=None):
    """Remove CPU all-reduce buffers (66 MiB each, in RAM-backed /dev/shm) that no live process maps
    and that are older than ``min_age_s`` (a starting job maps its buffer right after creating
    it): what earlier runs killed before the unlink left. Returns the removed paths."""
    now = time.time() if now is None else now
    mapped = mapped_paths() if mapped is None else mapped
    removed = []
    for path in glob.glob(SHM_BUFFERS):
        try:
            if path in mapped or now - os.stat(path).st_mtime < min_age_s:
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


class ExperimentRunner:

    def __init__(self, launcher_args, user_script, user_args, arg_mappings, timeout, env=None, base_port=None):
        self.launcher_args = list(launcher_args)
        self.base_port = base_port  # the user's --master_port: launch n (from 0) uses base_port + n
        self.launches = 0
        self.user_script = user_script
        self.user_args = list(user_args)
        self.arg_mappings = dict(arg_mappings)
        self.timeout = timeout
        self.env = dict(os.environ if env is None else env)

    def next_port(self):
        """The port of the next launch: the user's --master_port counted up (a port a killed
        experiment held may still be in TIME_WAIT), else a free one."""
        port = free_port() if self.base_port is None else self.base_port + self.launches
        self.launches += 1
        return port

    def command(self, experiment, config_path, port):
        return [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *self.launcher_args, "--master_port",
                str(port), self.user_script, *experiment_args(self.user_args, config_path, self.arg_mappings,
                                                              experiment)]

    def run(self, experiment, config, exp_dir):
        """Run and classify; returns (status, message, metrics or None, seconds)."""
        os.makedirs(exp_dir, exist_ok=True)
        config_path = os.path.join(exp_dir, "ds_config.json")
        metric_path = config["autotuning"]["metric_path"]
        if os.path.exists(metric_path):
            os.remove(metric_path)  # a file left by an earlier run must never be read as this one's
        with open(config_path, "w") as handle:
            json.dump(config, handle, indent=2)
        port = self.next_port()
        command = self.command(experiment, config_path, port)
        with open(os.path.join(exp_dir, "cmd.txt"), "w") as handle:
            handle.write(" ".join(command) + "\n")
        began, began_epoch = time.monotonic(), time.time()
        timed_out = False
        stale_locks = []
        roots = extension_roots(self.env)
        with open(os.path.join(exp_dir, "stdout.log"), "w") as out, open(os.path.join(exp_dir, "stderr.log"),
                                                                           "w") as err:
            process = subprocess.Popen(command, stdout=out, stderr=err, env=self.env, start_new_session=True)
            try:
                timed_out, building = self._wait(process, began, began_epoch, roots)
            except BaseException:
                kill_group(process, grace=2.0)
                raise
            finally:
                # The launcher may be gone while a rank still hangs in a collective: the whole
                # group goes, every time.
                kill_group(process, grace=0.0 if not timed_out else 10.0)
                process.wait()
                if timed_out or process.returncode != 0:
                    stale_locks = remove_build_locks(roots, began_epoch)
                remove_shm_buffers(port)
        seconds = time.monotonic() - began
        stdout = _read(os.path.join(exp_dir, "stdout.log"))
        stderr = _read(os.path.join(exp_dir, "stderr.log"))
        metrics = None
        if not timed_out and os.path.exists(metric_path):
            with open(metric_path) as handle:
                metrics = json.load(handle)
        status, message = classify(process.returncode, stderr, stdout, metrics_present=metrics is not None,
                                   timed_out=timed_out)
        if status != OK:
            metrics = None
        if timed_out:
            message = message.replace("(autotuning.experiment_timeout)",
                                      f"(autotuning.experiment_timeout = {self.timeout:g} s)")
            if building >= POLL_S:
                message += f" ({min(building, BUILD_ALLOWANCE_S):.0f} s of JIT op builds not counted"
                message += (f"; its builds ran past the {BUILD_ALLOWANCE_S:.0f} s allowance)"
                            if building > BUILD_ALLOWANCE_S else ")")
            orphans = orphaned_build_locks(roots)
            if orphans:
                message += (f"; JIT build lock(s) that no process holds, left by a process killed mid-build before "
                            f"this experiment: {', '.join(orphans)}: a rank that loads the op waits on such a lock "
                            f"forever; remove them")
        if stale_locks:
            message += (f"; removed the JIT build lock(s) its killed ranks left ({', '.join(stale_locks)}): "
                        f"an op build was cut short, and the next experiment that needs the op builds it again")
        return status, message, metrics, seconds

    def _wait(self, process, began, began_epoch, roots):
        """Wait for the experiment until ``timeout`` seconds of it have passed, not counting time
        (up to ``BUILD_ALLOWANCE_S``) while one of its own processes holds a JIT build lock: a
        first build takes minutes on a small machine and says nothing about the configuration.
        Returns (timed_out, seconds spent building)."""
        building = 0.0
        last = began
        while True:
            try:
                process.wait(timeout=POLL_S)
                return False, building
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            locks = build_locks(roots, began_epoch)
            holders = lock_holders(locks) if locks else {}
            if holders and any(_in_group(pid, process.pid) for pids in holders.values() for pid in pids):
                building += now - last
            last = now
            if now - began - min(building, BUILD_ALLOWANCE_S) >= self.timeout:
                return True, building


def _read(path):
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return ""
