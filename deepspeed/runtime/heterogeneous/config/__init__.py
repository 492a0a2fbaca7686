# SPDX-License-Identifier: Apache-2.0
"""The ``heterogeneous_config`` block and the ZeRO keys the fork adds: pydantic models
(``blocks``) and their loading from a ds_config (``settings``).

The lowest layer: it imports nothing else of the fork, so every other layer may read settings.
"""
