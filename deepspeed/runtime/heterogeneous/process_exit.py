# SPDX-License-Identifier: Apache-2.0
"""The documented path of ``end_process``: this name is ``cli/process_exit.py`` itself."""

import sys

from .cli import process_exit as _module

sys.modules[__name__] = _module
