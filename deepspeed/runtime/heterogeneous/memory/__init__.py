# SPDX-License-Identifier: Apache-2.0
"""What a rank holds and where: model-state bytes and the activation meter (``model_state``),
the peak DeepSpeed's ZeRO stages reach (``peak``, ``spec``), the measured peak (``meter``) and what
the runtime controller follows of it during training (``rank_memory``), the
memory pool, its placement decisions and report (``pool``, ``rank_placement``, ``placement``,
``report``), uneven ZeRO-1/2 partitions (``partitions``), memory-proportional ZeRO-3 shards (``zero3_shards``),
gradient chunking (``chunking``) and the ZeRO-3 settings (``zero3_settings``).

Pure decisions: no collective here (the start-up code gathers what they need).
May import: ``config``, ``measure``, ``cluster`` (types only), ``emulation``.
"""
