# SPDX-License-Identifier: Apache-2.0
"""Training frameworks on top of the engine: the Hugging Face ``Trainer`` (``hf_trainer``) and
the check of how its loss is normalised over items (``loss_normalization``).

May import every subpackage and the top-level modules' public API only through
``deepspeed.initialize``.
"""
