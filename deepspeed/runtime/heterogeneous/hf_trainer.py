# SPDX-License-Identifier: Apache-2.0
"""The documented path of the Hugging Face Trainer integration: this name is
``integrations/hf_trainer.py`` itself (one module object, so attributes and patches agree)."""

import sys

from .integrations import hf_trainer as _module

sys.modules[__name__] = _module
