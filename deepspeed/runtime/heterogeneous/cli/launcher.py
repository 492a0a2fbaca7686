# SPDX-License-Identifier: Apache-2.0
"""What the ``deepspeed`` launcher does for the fork before it launches anything."""

import importlib.util
import os
import signal
import socket
import sys

from ..config.settings import ENV_ADAPTIVE_SCHEDULING, ENV_ENABLE, env_flag, load_heterogeneous_settings

# Forwarded to every rank, also on remote nodes (pdsh, mpi, ...): the ranks read them at
# deepspeed.initialize, so a variable set only on the launching host would split the cluster
# into ranks that balance and ranks that do not.
FORWARDED_ENVS = (ENV_ENABLE, ENV_ADAPTIVE_SCHEDULING)

SUBCOMMANDS = ("env_report", "plan")


def dispatch_subcommand(argv):
    """Run ``deepspeed env_report ...`` or ``deepspeed plan ...`` (``plan.py``: a described
    cluster, no device used); returns False when argv is an ordinary launch."""
    if not argv or argv[0] not in SUBCOMMANDS:
        return False
    if argv[0] == "plan":
        from .plan import main
        sys.exit(main(argv[1:]))
    pin_detected_accelerator()
    from deepspeed.env_report import cli_main
    sys.exit(cli_main(argv[1:]))


def pin_detected_accelerator(environ=None):
    """Make every later accelerator detection in this process, and in the processes it starts,
    agree with the first, silently.

    The ``deepspeed`` launcher calls this once per launch: its local launcher and every rank
    inherit DS_ACCELERATOR, so "Setting accelerator to CPU" is warned once per job, not by each
    process (six times for two ranks). Remote hosts are not told: each detects its own.

    Run from a source checkout (the repository root on sys.path), the report imports upstream's
    op list, which prefers the checkout's top-level ``accelerator`` package to
    ``deepspeed.accelerator``: a second copy with its own cache, whose detection warned "Setting
    accelerator to CPU" a second time. Naming the detected accelerator in DS_ACCELERATOR, the
    override every copy reads, makes that copy take it without detecting again.
    """
    environ = os.environ if environ is None else environ
    if "DS_ACCELERATOR" not in environ:
        from deepspeed.accelerator import get_accelerator
        environ["DS_ACCELERATOR"] = get_accelerator()._name


def check_launch_environment(argv=(), environ=None):
    """Stop with one line, before any rank starts, when a fork variable has a bad value or the
    fork's blocks of the ds_config named in the user's arguments are invalid.

    Every rank would fail the same way, each with a full traceback; here the error is shown once.

    Args:
        argv: the launcher's command line (``sys.argv[1:]``); the config is the file after
            ``--deepspeed_config`` (or ``--deepscale_config``), as ``--flag PATH`` or ``--flag=PATH``.
            Default (): no config to check.
        environ: the environment to read the fork's variables from (default ``os.environ``).

    Exits with status 2 and ``deepspeed: invalid DeepSpeed config <path>: <message>`` for an
    invalid fork block. A config file that cannot be read or parsed is left to upstream, and so
    is every upstream key: only the fork's blocks are checked, with the world size unknown.
    """
    environ = os.environ if environ is None else environ
    for name in FORWARDED_ENVS:
        try:
            env_flag(name, environ)
        except ValueError as exc:
            sys.exit(f"deepspeed: error: {exc}")
    path = config_path_in(argv)
    if path is None:
        return
    from .env_report import read_config_file
    try:
        param_dict = read_config_file(path)
    except ValueError:
        return  # unreadable or not JSON: the ranks report it as upstream does
    try:
        load_heterogeneous_settings(param_dict, world_size=None, environ=environ)
    except ValueError as exc:
        message = " ".join(str(exc).split()).removeprefix("invalid DeepSpeed config: ")
        print(f"deepspeed: invalid DeepSpeed config {path}: {message}", file=sys.stderr)
        sys.exit(2)


def check_master_port(args):
    """Stop with one line, before any rank starts, when a launch on this host only would find its
    rendezvous port (``--master_port``, default 29500) taken: every rank would otherwise end in an
    ``EADDRINUSE`` traceback. Launches that name other hosts (a hostfile, ``--master_addr``) are
    left to the ranks: the port is another host's."""
    import socket
    if os.path.isfile(getattr(args, "hostfile", "") or "") or getattr(args, "master_addr", "") not in ("", "localhost",
                                                                                                      "127.0.0.1"):
        return
    port = int(getattr(args, "master_port", 0) or 0)
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as free:
                free.bind(("", 0))
                suggestion = free.getsockname()[1]
            print(f"deepspeed: error: port {port} (--master_port) is already in use on this host, so the ranks could "
                  f"not meet there; pass a free one, e.g. --master_port {suggestion}", file=sys.stderr)
            sys.exit(2)


CONFIG_FLAGS = ("--deepspeed_config", "--deepscale_config")


def config_path_in(argv):
    """The ds_config path given to the training script in ``argv``, or None (the last one wins,
    as with argparse)."""
    path = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        if equals:
            path = value
        elif index + 1 < len(argv):
            path = argv[index + 1]
    return path


# Set by torch's and DeepSpeed's launchers on each rank they start.
TORCH_LAUNCHER_ENVS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# World sizes set by MPI launchers (Open MPI, MPICH/Intel MPI, MVAPICH) and Slurm's srun.
MPI_WORLD_SIZE_ENVS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")


def single_process_fallback(environ=None):
    """Let ``python train.py``, started without any launcher, run as one process.

    Upstream's ``init_distributed`` then discovers ranks through MPI, which needs mpi4py and
    fails without it. When no launcher started the process (none of RANK, LOCAL_RANK, WORLD_SIZE;
    no MPI or Slurm world of more than one process) and mpi4py is not importable, this sets
    RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT (keeping
    MASTER_ADDR/MASTER_PORT when they are set) and logs one line saying so.

    Args:
        environ: the environment to read and complete (default ``os.environ``).

    Returns:
        True when the single-process variables were set (MPI discovery must be skipped), False
        when the caller should go on to MPI discovery as upstream does.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in TORCH_LAUNCHER_ENVS):
        return False
    # Several processes without mpi4py would each train alone, silently: leave those to upstream's
    # error.
    if any(_int_or_zero(environ.get(name)) > 1 for name in MPI_WORLD_SIZE_ENVS):
        return False
    if importlib.util.find_spec("mpi4py") is not None:
        return False
    environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in environ:
        environ["MASTER_PORT"] = str(_free_local_port())
    from deepspeed.utils import logger
    logger.info("No launcher environment (RANK, WORLD_SIZE, ...) and no mpi4py: running as a single process "
                f"(RANK=0, WORLD_SIZE=1, MASTER_ADDR={environ['MASTER_ADDR']}, MASTER_PORT={environ['MASTER_PORT']})")
    return True


def _int_or_zero(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _free_local_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forward_termination_signals(child):
    """Pass SIGINT and SIGTERM that reach the runner on to ``child`` (a ``subprocess.Popen``).

    The runner starts one child (``deepspeed.launcher.launch`` on a single node, or the MPI/Slurm
    launcher) and waits for it. Upstream's runner simply dies on these signals, and its child and
    every rank are re-parented to PID 1 and keep training; launch.py already terminates its ranks
    on either signal, so forwarding it is enough. The runner keeps waiting for the child, which
    exits non-zero, and exits with its status. Only a signal sent to the runner alone needs this:
    Ctrl-C in a terminal reaches the whole foreground process group anyway.
    """

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
