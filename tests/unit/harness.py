"""Multi-process test harness of deepspeed-hetero: ranks on the CPU accelerator with gloo.

Entry points:

- ``run_ranks(fn, ...)``: spawn ranks that each initialise DeepSpeed's gloo backend and call
  ``fn(rank, world_size, *args)``; returns the per-rank results.
- ``run_subcases(fn, cases, ...)``: run many parameter sets inside one spawned group, so that
  process start-up and ``import deepspeed`` (seconds each) are paid once.
- ``launch_deepspeed(script, ...)``: run a script under the real ``deepspeed`` launcher.
- ``VirtualDevice``: a rank whose timers read a clock that only its model's work moves, for
  tests of what the fork decides from measured times (the decision is then the same in every run).
- ``warm_shm_comm_op(...)``: build the JIT op every rank loads at start-up, once, before ranks
  race for its build directory (``tests/conftest.py`` calls it once per session).

All processes started here build and load JIT ops the same way (see ``fork_environment``), so
that consecutive runs never invalidate each other's builds.

Failures come back as ``AssertionError`` carrying the failing rank's traceback. A group that does
not finish in time is killed together with all its descendants, and the error names the ranks
that were still running; each of them first prints its threads' stacks on its stderr. JIT build
locks that no process holds (a rank killed while it built an op leaves one, and torch would wait
on it forever) are removed from the tests' build directory before a group starts and after one
was killed.
"""

import contextlib
import datetime
import faulthandler
import functools
import importlib.util
import multiprocessing
import glob
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]

# After one rank fails, its peers usually fail too or block in a collective; give them this long
# to report their own error before the group is killed.
FAILURE_GRACE_S = 5.0
# Time a rank that already reported gets to exit (destroy its process group, flush output).
EXIT_GRACE_S = 10.0
# Seconds a rank about to be killed has to print its stacks.
STACK_DUMP_WAIT_S = 1.0

_issued_ports = set()
_port_lock = threading.Lock()

# Set in spawned ranks only: the pipe on which a rank reports progress and its result.
_report = None


def check_collectives_per_group(results):
    """``results[rank]["collectives"]``: ``{(thread, group ranks): [collective, ...]}`` as each rank
    recorded them; asserts that each group's sequence, per thread, is the same on every member."""
    groups = {}
    for rank, result in enumerate(results):
        for (thread, group), sequence in result["collectives"].items():
            assert rank in group, (rank, group)
            groups.setdefault((thread, group), {})[rank] = sequence
    for (thread, group), by_rank in groups.items():
        assert sorted(by_rank) == sorted(group), (thread, group, sorted(by_rank))
        for rank, sequence in by_rank.items():
            assert sequence == by_rank[group[0]], (thread, group, rank)


def predicted_state_bytes(model, stage, world, optimizer):
    """What the fork's one memory model (``memory/spec.ModelStateSpec``) counts for one rank of
    ``model`` besides activations, under ZeRO ``stage`` on ``world`` ranks with equal shares, the
    config's ``optimizer`` block and a device apart from the host (``emulation.memory_gb`` by
    accounting, mode ``dilation``; under a memory cgroup the host is the device and counts
    otherwise): tests size emulated capacities with it, as the fork's start-up caps and profiling
    limits count."""
    from dataclasses import replace
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.heterogeneous.memory.spec import ModelStateSpec
    config = DeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                              "optimizer": optimizer})
    spec = ModelStateSpec.for_engine(config, model, emulated_device=True)
    spec = replace(spec, allocations=replace(spec.allocations, world=int(world)))
    return spec.device_bytes(int(world), None)


def require_cpu_quotas(min_cores=1):
    """Skip the calling test, saying why, where CPU-quota cgroups cannot be used (not root, no cpu
    controller, fewer than ``min_cores`` cores); fail instead under CI, which must run it."""
    reason = None
    if os.geteuid() != 0:
        reason = "not root"
    else:
        from deepspeed.runtime.heterogeneous.measure.cgroup_files import find_hierarchy
        if find_hierarchy("cpu") is None:
            reason = "no cpu cgroup controller"
        elif len(os.sched_getaffinity(0)) < min_cores:
            reason = f"fewer than {min_cores} cores"
    if reason:
        import pytest
        assert os.environ.get("CI") != "true", f"CI must run the CPU-quota tests: {reason}"
        pytest.skip(f"CPU-quota cgroups unusable here: {reason}")


@contextlib.contextmanager
def busy_loops(count, core=None):
    """``count`` processes spinning beside the caller (on ``core`` alone, when given) until the
    block ends: a machine with other work. They are killed on exit, also on failure."""
    pin = f"import os\nos.sched_setaffinity(0, {{{core}}})\n" if core is not None else ""
    spinners = [subprocess.Popen([sys.executable, "-c", pin + "while True:\n    pass\n"]) for _ in range(count)]
    try:
        yield spinners
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


class VirtualDevice:
    """A device whose time is virtual: while ``installed()``, ``time.perf_counter`` (which every
    timer of the fork reads) returns a clock that moves only when the model calls ``compute`` for
    its rows, by ``rows * seconds_per_sample / speed``, and by one nanosecond per reading (so that
    a loop waiting for time to pass ends). Collectives then take no time, a rank's own time is its
    work, and the slowest rank's own time is the step's: the fork decides from times that are the
    same in every run, on a quiet machine or a loaded one. Set ``speed`` before each step to follow
    a schedule. Real time (``time.monotonic``, ``time.time``: timeouts, logs) is untouched."""

    TICK_S = 1e-9

    def __init__(self, seconds_per_sample, speed=1.0):
        self.seconds_per_sample = seconds_per_sample
        self.speed = speed
        self.now = 0.0

    def perf_counter(self):
        self.now += self.TICK_S
        return self.now

    def compute(self, rows):
        self.now += rows * self.seconds_per_sample / self.speed

    @contextlib.contextmanager
    def installed(self):
        real = time.perf_counter
        self.now = max(self.now, real())  # marks taken before stay in the past
        time.perf_counter = self.perf_counter
        try:
            yield self
        finally:
            time.perf_counter = real

    def layer(self):
        """A ``torch.nn.Module`` that passes its input through and charges its rows to this device."""
        import torch

        device = self

        class VirtualWork(torch.nn.Module):

            def forward(self, x):
                device.compute(x.shape[0])
                return x

        return VirtualWork()


def free_port():
    """Return a TCP port that is free on 127.0.0.1 and was not handed out before by this process.

    The kernel may offer a just-released port again, and a previous group's master port can still
    be in TIME_WAIT, so ports are never reused within one test session.
    """
    with _port_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port not in _issued_ports:
                _issued_ports.add(port)
                return port
    raise RuntimeError("no unused free TCP port found on 127.0.0.1")


@functools.cache
def load_patchset():
    """The repository's ``scripts/patchset.py`` as a module (pin, sdist cache, pristine trees)."""
    spec = importlib.util.spec_from_file_location("patchset", REPO_ROOT / "scripts" / "patchset.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fork_environment():
    """Variables that make a process build and load the fork's JIT ops like every other test rank.

    The CPU accelerator takes its op builders from a top-level ``op_builder`` package when one is
    importable (the repository root on sys.path), else from ``deepspeed.ops.op_builder``; the two
    compile different copies of csrc/, and torch's JIT cache, keyed on source paths, rebuilds an
    op (minutes on two cores) whenever consecutive runs disagree. Test processes therefore always
    see the repository root, and build in a directory of their own (unless TORCH_EXTENSIONS_DIR
    is set) that runs outside the tests, from other working directories, cannot invalidate.

    Every test process also checks that no process group is used by two threads at once
    (``comm_clock.check_group_threads``: the overlap worker beside the main thread).
    """
    default_dir = load_patchset().cache_dir() / "torch_extensions" / "tests"
    return {
        "PYTHONPATH": str(REPO_ROOT),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(default_dir),
        "DEEPSPEED_HETERO_CHECK_GROUP_THREADS": "1",
    }


def _merged_environ(*layers):
    """os.environ with each layer applied in turn; ``None`` as a value removes the variable."""
    variables = dict(os.environ)
    for layer in layers:
        for name, value in (layer or {}).items():
            if value is None:
                variables.pop(name, None)
            else:
                variables[name] = str(value)
    return variables


def _default_threads(world_size):
    # Ranks share the machine's cores; oversubscribed OpenMP threads make every step slower.
    return str(max(1, (os.cpu_count() or 1) // world_size))


def rank_environment(rank, world_size, port, env=None):
    """The environment variables a rank of a local CPU group needs, with ``env`` on top."""
    variables = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_SIZE": str(world_size),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", _default_threads(world_size)),
        "TORCH_EXTENSIONS_DIR": fork_environment()["TORCH_EXTENSIONS_DIR"],
        "DEEPSPEED_HETERO_CHECK_GROUP_THREADS": "1",
    }
    variables.update(env or {})
    return variables


@contextlib.contextmanager
def patched_environ(variables):
    """Set ``variables`` (None: unset) in os.environ for the block; restore them after."""
    # A spawned child unpickles its target, importing the target's module, before any code of
    # ours runs there; the variables must therefore be in the environment it inherits at start.
    saved = {name: os.environ.get(name) for name in variables}
    try:
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _kill_process_tree(pid):
    """Kill a process and every descendant (ninja builds, data-loader workers, launcher ranks)."""
    try:
        root = psutil.Process(pid)
        victims = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    psutil.wait_procs(victims, timeout=10)


def clear_stale_build_locks(extensions_dir, min_age_s=None):
    """Remove the JIT build locks in ``extensions_dir`` (the tests' own) that no build holds.

    torch waits without end on a build lock whose process died, and a rank killed while it built an
    op leaves one: every later test that loads the op would hang, also on a machine started from a
    copy of this one. A lock goes when ``op_builder.jit_announce.stale_build_lock`` finds nothing
    building in its directory, after ``min_age_s`` quiet seconds (default its own; 0 once the
    processes that could hold it are known dead).

    Returns: a line naming the locks removed, or ''.
    """
    from op_builder.jit_announce import STALE_LOCK_AGE_S, stale_build_lock
    removed = []
    for lock in sorted(Path(extensions_dir).glob("*/lock")) if extensions_dir else ():
        if stale_build_lock(str(lock.parent), STALE_LOCK_AGE_S if min_age_s is None else min_age_s):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
                removed.append(str(lock))
    return f"\nremoved JIT build lock(s) that nothing held any more: {', '.join(removed)}" if removed else ""


def _send(conn, message):
    # Plain pickle, not the connection's: multiprocessing pickles tensors as shared-memory handles
    # that the sending rank must keep serving, and a rank may exit right after reporting.
    conn.send_bytes(pickle.dumps(message))


def _receive(conn):
    """The next report of a rank, or None once the rank has exited (end of its pipe)."""
    try:
        data = conn.recv_bytes()
    except EOFError:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return ("error", "the parent could not unpickle the rank's report:\n" + traceback.format_exc())


def _rank_entry(conn, fn, args, collective_timeout_s):
    """Body of a spawned rank: initialise gloo, run ``fn``, report, tear the group down."""
    global _report
    _report = conn
    # Spawned ranks take the parent's sys.path, not PYTHONPATH; see fork_environment.
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    # A group that times out asks its ranks for their stacks (SIGUSR1) before it kills them.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    message = None
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo",
                                   timeout=datetime.timedelta(seconds=collective_timeout_s),
                                   verbose=False)
        value = fn(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), *args)
        message = ("ok", value)
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        _send(conn, message)
    except Exception:
        _send(conn, ("error", "the rank's return value could not be sent to the parent:\n" + traceback.format_exc()))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


class _GroupOutcome:
    """What the parent learned from a group: final reports, progress messages, lost ranks."""

    def __init__(self, world_size, timeout):
        self.world_size = world_size
        self.timeout = timeout
        self.final = {}  # rank -> ("ok", value) | ("error", traceback text)
        self.progress = {rank: [] for rank in range(world_size)}
        self.lost = {}  # rank -> exit code of a rank that died without a final report
        self.arrival = []  # ranks in the order their final report or exit arrived
        self.running = []  # ranks still running when the group timed out
        self.blocked = []  # ranks still running when a peer's failure ended the group
        self.stuck_at_exit = []  # ranks that reported but did not exit
        self.lock_hint = ""  # the build locks removed after ranks had to be killed

    def problems(self):
        """Describe every rank-level failure, or return an empty list."""
        lines = []
        # In order of arrival: the first failure is usually the cause, later ones its echo in peers.
        for rank in self.arrival:
            if rank in self.lost:
                lines.append(f"rank {rank} exited with code {self.lost[rank]} without reporting a result (crash or "
                             f"kill; its stderr is in the captured output)")
            elif self.final[rank][0] == "error":
                lines.append(f"rank {rank} raised:\n{self.final[rank][1]}")
        if self.running:
            lines.append(f"timed out after {self.timeout}s; ranks still running (killed): {self.running}")
        if self.blocked:
            lines.append(f"ranks {self.blocked} had not finished {FAILURE_GRACE_S}s after a peer failed (killed)")
        if self.stuck_at_exit:
            lines.append(f"ranks {self.stuck_at_exit} reported but did not exit within {EXIT_GRACE_S}s "
                         f"(killed)")
        return lines


def remove_shm_buffers(port):
    """Upstream's CPU shared-memory all-reduce leaves two 66 MiB files in /dev/shm per group (named
    after the master port) and never unlinks them; hundreds of groups fill the RAM-backed /dev/shm
    until the machine thrashes. The group is over, so its buffers can go."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _run_group(fn, args, world_size, timeout, env):
    """Spawn the group, collect its messages, always reap it; return a ``_GroupOutcome``."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    outcome = _GroupOutcome(world_size, timeout)
    procs, readers = [], []
    deadline = time.monotonic() + timeout
    extensions_dir = rank_environment(0, world_size, port, env).get("TORCH_EXTENSIONS_DIR")
    clear_stale_build_locks(extensions_dir)
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_entry, args=(writer, fn, args, timeout), name=f"rank{rank}")
            with patched_environ(rank_environment(rank, world_size, port, env)):
                proc.start()
            # Only the child may hold the write end: its exit must show up as EOF here.
            writer.close()
            procs.append(proc)
            readers.append(reader)

        open_ranks = set(range(world_size))
        failure_deadline = None
        while open_ranks:
            limit = deadline if failure_deadline is None else min(deadline, failure_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait_for_any([readers[rank] for rank in open_ranks], timeout=remaining):
                rank = readers.index(conn)
                message = _receive(conn)
                if message is None:
                    procs[rank].join(timeout=EXIT_GRACE_S)
                    outcome.lost[rank] = procs[rank].exitcode
                elif message[0] in ("ok", "error"):
                    outcome.final[rank] = message
                else:
                    outcome.progress[rank].append(message)
                    continue
                outcome.arrival.append(rank)
                open_ranks.discard(rank)
                if failure_deadline is None and (message is None or message[0] == "error"):
                    failure_deadline = time.monotonic() + FAILURE_GRACE_S
        if failure_deadline is not None and failure_deadline < deadline:
            outcome.blocked = sorted(open_ranks)
        else:
            outcome.running = sorted(open_ranks)

        exit_deadline = time.monotonic() + EXIT_GRACE_S
        for rank, proc in enumerate(procs):
            if rank in outcome.final:
                proc.join(timeout=max(0.0, exit_deadline - time.monotonic()))
                if proc.is_alive():
                    outcome.stuck_at_exit.append(rank)
    finally:
        killed = [proc for proc in procs if proc.is_alive()]
        for proc in killed:  # one at a time, each under a header, prints its threads' stacks (see _rank_entry)
            print(f"--- {proc.name} (pid {proc.pid}) is killed; its stacks: ---", file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(STACK_DUMP_WAIT_S)
        for proc in killed:
            _kill_process_tree(proc.pid)
        for proc in procs:
            proc.join()
        for reader in readers:
            reader.close()
        remove_shm_buffers(port)
    if killed:
        outcome.lock_hint = clear_stale_build_locks(extensions_dir, min_age_s=0)
    return outcome


def run_ranks(fn, world_size=2, timeout=120, args=(), env=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks joined by gloo.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks (default 2, one per core of the test machines).
        timeout: seconds for the whole group, start-up included (default 120); also the
            collective timeout of the process group.
        args: extra positional arguments for ``fn``.
        env: environment variables set in every rank on top of the rank variables
            (``None`` as a value removes a variable).

    Returns:
        The list of per-rank return values, indexed by rank.

    Raises:
        AssertionError: a rank raised (the message holds its traceback and names the rank), died
            without reporting, or the group did not finish within ``timeout`` (the message names
            the ranks still running; they and their descendants are killed).
    """
    outcome = _run_group(fn, tuple(args), world_size, timeout, env)
    problems = outcome.problems()
    if problems:
        raise AssertionError(f"{world_size}-rank group of {_describe(fn)} failed:\n" + "\n".join(problems) +
                             outcome.lock_hint)
    return [outcome.final[rank][1] for rank in range(world_size)]


def _describe(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _format_case(case):
    return "{" + ", ".join(f"{key}={value!r}" for key, value in case.items()) + "}"


def _subcase_body(rank, world_size, fn, cases):
    """Rank-side loop of ``run_subcases``: run every case, report each outcome as it happens."""
    import torch.distributed as dist

    # A case that fails on one rank only can leave the default group mid-collective; aligning the
    # ranks on a group of its own keeps the next case from pairing with that stale collective.
    boundary_group = dist.new_group(backend="gloo")
    values = []
    for index, case in enumerate(cases):
        _send(_report, ("start", index))
        # Each case is a job of its own, often on other (emulated) devices or hosts, which a real
        # process never sees change: the fork's per-process cache of its start-up collectives'
        # results does not carry over from the case before.
        state = sys.modules.get("deepspeed.runtime.heterogeneous.coordinator")
        if state is not None:
            state.facts.clear()
        try:
            values.append(fn(rank, world_size, **case))
            _send(_report, ("case", index, None))
        except Exception:
            values.append(None)
            _send(_report, ("case", index, traceback.format_exc()))
        dist.barrier(group=boundary_group)
    return values


def run_subcases(fn, cases, world_size=2, timeout=300, env=None):
    """Run ``fn(rank, world_size, **case)`` for every case inside one spawned group.

    Start-up is paid once for all cases. Every case runs even when an earlier one failed; ranks
    align at a barrier between cases. A case that hangs ends the group at ``timeout``.

    Args:
        fn: a module-level (picklable) function taking ``rank, world_size`` and the case's keys.
        cases: list of keyword-argument dictionaries, one per sub-case.
        world_size, timeout, env: as for ``run_ranks`` (``timeout`` covers all cases).

    Returns:
        ``results[case_index][rank]``: the return values of ``fn``.

    Raises:
        AssertionError: naming each failing case by its parameters, with the rank and traceback;
            a time-out also names the case each still-running rank was in.
    """
    cases = [dict(case) for case in cases]
    outcome = _run_group(_subcase_body, (fn, cases), world_size, timeout, env)
    failures, current = {}, {}
    for rank, messages in outcome.progress.items():
        for message in messages:
            if message[0] == "start":
                current[rank] = message[1]
            elif message[0] == "case":
                current.pop(rank, None)
                if message[2] is not None:
                    failures.setdefault(message[1], []).append((rank, message[2]))
    lines = []
    for index in sorted(failures):
        for rank, text in failures[index]:
            lines.append(f"case {index} {_format_case(cases[index])} failed on rank {rank}:\n{text}")
    for rank in outcome.running + outcome.blocked + sorted(outcome.lost):
        if rank in current:
            lines.append(f"rank {rank} did not finish case {current[rank]} {_format_case(cases[current[rank]])}")
    lines += outcome.problems()
    if lines:
        raise AssertionError(f"sub-cases of {_describe(fn)} on {world_size} ranks failed:\n" + "\n".join(lines) +
                             outcome.lock_hint)
    return [[outcome.final[rank][1][index] for rank in range(world_size)] for index in range(len(cases))]


def deepspeed_launcher():
    """Path of the ``deepspeed`` launcher installed next to the running interpreter."""
    return str(Path(sys.executable).parent / "deepspeed")


def launch_deepspeed(script, script_args=(), num_ranks=2, timeout=300, env=None, cwd=None):
    """Run ``script`` on ``num_ranks`` local CPU ranks under the real ``deepspeed`` launcher.

    On the CPU accelerator the launcher counts "devices" as NUMA nodes (or LOCAL_SIZE), usually 1;
    ``--num_gpus N`` overrides that and starts N local ranks. Each rank gets ``--local_rank=R``
    appended to ``script_args``.

    Args:
        script: path of the training script.
        script_args: arguments for the script.
        num_ranks: local ranks to start (default 2).
        timeout: seconds before the launcher and all its ranks are killed (default 300).
        env: variables set on top of this process's environment and ``fork_environment()``
            (``None`` as a value removes one); set PYTHONPATH and TORCH_EXTENSIONS_DIR to run
            another DeepSpeed.
        cwd: working directory of the launcher (default: this process's).

    Returns:
        ``(returncode, output)``: the launcher's exit status and its stdout and stderr merged
        (the ranks' output included).

    Raises:
        AssertionError: the run did not finish within ``timeout``; the message ends with the
            output's tail.
    """
    variables = _merged_environ(
        {
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", _default_threads(num_ranks))
        }, fork_environment(), env)
    port = free_port()
    command = [deepspeed_launcher(), "--num_gpus", str(num_ranks), "--master_port", str(port),
               str(script), *map(str, script_args)]
    clear_stale_build_locks(variables.get("TORCH_EXTENSIONS_DIR"))
    # A session of its own: on time-out the launcher, its per-node launcher and every rank go at once.
    proc = subprocess.Popen(command, cwd=cwd, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        output, _ = proc.communicate()
        raise AssertionError(f"deepspeed launcher did not finish within {timeout}s (killed): {' '.join(command)}"
                             f"{clear_stale_build_locks(variables.get('TORCH_EXTENSIONS_DIR'), min_age_s=0)}\n"
                             f"--- output tail ---\n{output[-8000:]}")
    finally:
        _kill_session(proc)
        remove_shm_buffers(port)
    return proc.returncode, output


def _kill_session(proc):
    # The launcher's ranks share its process group; kill stragglers even after a normal exit.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


SHM_WARMUP_CODE = """
from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
if builder is not None and builder.is_compatible():
    builder.load(verbose=False)
"""


def warm_shm_comm_op(env=None, cwd=REPO_ROOT, timeout=1200):
    """Build, or confirm built, the shared-memory comm op DeepSpeed's torch backend loads.

    Every rank loads it in ``init_distributed``. Unbuilt, the ranks of a group queue on torch's
    build lock inside their start-up time-out, and a rank killed mid-build leaves a stale lock
    that blocks every later run. Runs in a subprocess, so that ``env`` applies (default: the
    fork, as its ranks see it; a pristine upstream passes its own PYTHONPATH and
    TORCH_EXTENSIONS_DIR), and costs one ``import deepspeed`` when the op is already built.

    Raises:
        RuntimeError: the build failed or took longer than ``timeout`` seconds.
    """
    variables = _merged_environ({"DS_ACCELERATOR": "cpu"}, fork_environment() if env is None else env)
    clear_stale_build_locks(variables.get("TORCH_EXTENSIONS_DIR"))
    # A session of its own, so that a time-out also ends the compilers ninja started.
    proc = subprocess.Popen([sys.executable, "-c", SHM_WARMUP_CODE], env=variables, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        output, _ = proc.communicate()
        raise RuntimeError(f"building the shm comm op took over {timeout}s (killed)"
                           f"{clear_stale_build_locks(variables.get('TORCH_EXTENSIONS_DIR'), min_age_s=0)}\n"
                           f"{output[-4000:]}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"building the shm comm op failed (exit {proc.returncode}):\n{output[-4000:]}")
