# SPDX-License-Identifier: Apache-2.0
"""The ``heterogeneous_config`` block and the ZeRO keys the fork adds: pydantic models
(``blocks``), their loading from a ds_config (``settings``), the wording of config errors
(``errors``) and the registry of load-balancing strategies (``strategies``).

The lowest layer: it imports nothing else of the fork, so every other layer may read settings.
(The built-in strategies are found by their module's name when the registry is first read.)
"""
