# SPDX-License-Identifier: Apache-2.0
"""Command-line entry points: ``deepspeed env_report --heterogeneous`` (``env_report``; its
pipeline section ``pipeline_report``, the text helpers they share ``report_text``), ``deepspeed
plan`` (``plan``: a described cluster's plan as a table and JSON), the
launcher's checks and signal forwarding (``launcher``), and process exit after an error
(``process_exit``).

May import every subpackage below it.
"""
