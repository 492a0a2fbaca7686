# SPDX-License-Identifier: Apache-2.0
"""Communication for uneven links: the hierarchical gradient reduction and parameter gather
(``hierarchical``, ``host_groups``), link-aware bucket sizes (``link_buckets``), the collectives of
uneven ZeRO-3 shards (``uneven_shards``) and the status line the log and the env report print
(``status``).

May import: ``config``, ``measure``, ``cluster``, ``memory`` (the shard layout).
"""
