# SPDX-License-Identifier: Apache-2.0
"""Planning a cluster that may not exist: ``deepspeed plan`` (docs/planning.md).

A cluster description (``cluster_file``: hosts, device kinds from ``measure/device_table.py`` or
given by numbers, links) and a model description (``model_description``: a Hugging Face config
built on the meta device, the repository's own models, or numbers) go through the fork's own
planner (``planning/``), memory pool (``memory/``) and a communication model of its own
(``comm_model``), with no process group, for upstream's even split and for the fork's choice
(``cluster_plan``); ``report`` prints the result.

Pure: no collective, no device. May import: ``config``, ``measure``, ``memory``, ``planning``.
"""
