# SPDX-License-Identifier: Apache-2.0
"""Training frameworks on top of the engine: the Hugging Face ``Trainer`` (``hf_trainer``), and
how a loss normalised over items is weighted on each rank (``loss_normalization``: whether a
model's loss divides by the caller's count, and the weight every rank agrees on).

May import every subpackage and the top-level modules' public API only through
``deepspeed.initialize``.
"""
