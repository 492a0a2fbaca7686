# SPDX-License-Identifier: Apache-2.0
"""Training frameworks on top of the engine: the Hugging Face ``Trainer``
(``hf_trainer``).

May import every subpackage and the top-level modules' public API only through
``deepspeed.initialize``.
"""
