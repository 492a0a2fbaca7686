# SPDX-License-Identifier: Apache-2.0
"""What the ``deepspeed`` launcher does for the fork before it launches anything."""

import os
import sys

from .config import ENV_ADAPTIVE_SCHEDULING, ENV_ENABLE, env_flag

# Forwarded to every rank, also on remote nodes (pdsh, mpi, ...): the ranks read them at
# deepspeed.initialize, so a variable set only on the launching host would split the cluster
# into ranks that balance and ranks that do not.
FORWARDED_ENVS = (ENV_ENABLE, ENV_ADAPTIVE_SCHEDULING)

SUBCOMMANDS = ("env_report", )


def dispatch_subcommand(argv):
    """Run ``deepspeed env_report ...``; returns False when argv is an ordinary launch."""
    if not argv or argv[0] not in SUBCOMMANDS:
        return False
    from deepspeed.env_report import cli_main
    sys.exit(cli_main(argv[1:]))


def check_launch_environment(environ=None):
    """Stop with one line, before any rank starts, when a fork variable has a bad value."""
    environ = os.environ if environ is None else environ
    for name in FORWARDED_ENVS:
        try:
            env_flag(name, environ)
        except ValueError as exc:
            sys.exit(f"deepspeed: error: {exc}")
