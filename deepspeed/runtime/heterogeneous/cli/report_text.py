# SPDX-License-Identifier: Apache-2.0
"""Plain-text helpers the env report's sections share (``env_report``, ``pipeline_report``): a
per-rank entry of an optional list, and a table with aligned columns."""


def per_rank(values, rank):
    return values[rank] if values is not None and rank < len(values) else None


def format_table(header, rows):
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip()
             for line in (header, *rows)]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
