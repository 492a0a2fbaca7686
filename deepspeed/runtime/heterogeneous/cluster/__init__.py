# SPDX-License-Identifier: Apache-2.0
"""The collective edge and the cluster's shape: ``Agreement`` (``agreement``: every fork collective goes
through it, so a failure names the rank that did not answer), the host topology and link probe
(``topology``), each process's data-parallel rank and the device gather (``ranks``).

May import: ``config``, ``measure``.
"""
