# SPDX-License-Identifier: Apache-2.0
"""Emulated clusters on one machine: slower ranks by CPU-quota cgroups or time dilation,
smaller devices by memory cgroups or accounting (``emulator``, ``limits``), and the cgroups
themselves, created per rank and removed when a run ends, also when it fails (``cgroups``).

May import: ``config``, ``measure``, ``cluster``.
"""
