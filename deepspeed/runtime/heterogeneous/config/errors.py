# SPDX-License-Identifier: Apache-2.0
"""How a config mistake ends a job: once, on one line, from global rank 0.

Every rank reads the same config and fails alike, and a traceback from each of them buries the
one line that says what to change. An uncaught ``HeterogeneousConfigError`` therefore ends the
process with its message alone (``one_line_config_errors``), and a ds_config file that does not
parse raises one (``config_file_errors``), naming the file, the line and the column.
"""

import contextlib
import os
import sys

from .settings import HeterogeneousConfigError


def one_line_config_errors():
    """Have an uncaught ``HeterogeneousConfigError``, or an error every rank raised together at the
    same point (marked ``deepspeed_hetero_every_rank``: a mis-fed batch, ``reschedule_workload``
    with nothing measured), end the process with its message on one line, printed by global rank 0
    alone: every rank raises the same error, and N tracebacks of one mistake bury it. Other
    exceptions keep Python's own report."""
    if getattr(sys.excepthook, "deepspeed_hetero", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if isinstance(value, HeterogeneousConfigError):
            line = f"deepspeed: {value}"
        elif getattr(value, "deepspeed_hetero_every_rank", False):
            line = f"{kind.__name__}: {value}"
        else:
            return previous(kind, value, traceback)
        if os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)

    hook.deepspeed_hetero = True
    sys.excepthook = hook


def invalid_json_message(path, error):
    """The one line for a ds_config file at ``path`` that does not parse (``error``: hjson's or
    json's, whose text gives the line and column)."""
    return f"config {path} is not valid JSON: {error}"


@contextlib.contextmanager
def config_file_errors(path):
    """Around upstream's reading of the ds_config file at ``path`` (``DeepSpeedConfig``): a syntax
    error becomes a ``HeterogeneousConfigError`` (``invalid_json_message``) that ends the job with
    one line. Whether or not the fork is enabled: a file that does not parse cannot say."""
    import hjson
    try:
        yield
    except hjson.HjsonDecodeError as exc:
        one_line_config_errors()
        raise HeterogeneousConfigError(invalid_json_message(path, exc)) from None
