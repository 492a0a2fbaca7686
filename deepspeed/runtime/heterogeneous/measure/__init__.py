# SPDX-License-Identifier: Apache-2.0
"""What a rank measures about itself: step and phase timers (``timing``), the clock every
``deepspeed.comm`` collective reports to (``comm_clock``) and its per-rank record
(``collective_log``), the device description and score (``devices``, ``device_benchmark``,
``native``: the fork's C++/CUDA op), and the memory limit it runs under (``cgroup_files``).

May import: ``config``. Runs no collective.
"""
