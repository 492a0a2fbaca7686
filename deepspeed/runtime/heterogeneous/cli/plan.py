# SPDX-License-Identifier: Apache-2.0
"""``deepspeed plan --cluster C [--model M] [--config ds_config.json] [--json OUT]``: the plan of a
described cluster (``forecast/cluster_plan.plan_cluster``) as a table a person reads, and as JSON
(``--json``; ``-`` for stdout). ``--ds-config OUT`` writes the ds_config to launch with alone.

The launcher dispatches it (``launcher.dispatch_subcommand``) before it parses a training script's
arguments, as it does ``env_report``; no process group, no device is used.
"""

import argparse
import json
import sys

from ..forecast.cluster_file import load_cluster_file
from ..forecast.cluster_plan import plan_cluster
from ..memory.report import format_size
from .env_report import read_config_file
from .report_text import format_table


def main(argv=None):
    """Command line entry point; returns 0, or 2 with a one-line error on stderr."""
    parser = argparse.ArgumentParser(prog="deepspeed plan", description="Predict memory, step time and the "
                                     "settings the fork would choose on a described cluster, against upstream's "
                                     "even split (docs/planning.md).")
    parser.add_argument("--cluster", required=True, metavar="FILE", help="cluster description (JSON, or YAML with "
                        "PyYAML)")
    parser.add_argument("--model", metavar="M", help="a Hugging Face config JSON, tiny_gpt[.demo|.bench], or "
                        "numbers as JSON ('{\"parameters\": 7e9, \"layers\": 32, \"hidden\": 4096}'); default: "
                        "the cluster file's")
    parser.add_argument("--config", metavar="PATH", help="ds_config the plan starts from (default: the cluster "
                        "file's, else a plain one)")
    parser.add_argument("--json", metavar="OUT", help="write the plan as JSON ('-': stdout, no table)")
    parser.add_argument("--ds-config", metavar="OUT", help="write the ds_config to launch with")
    parser.add_argument("--no-largest", action="store_true", help="skip the search for the largest model that fits")
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster_file(args.cluster)
        model = _model_argument(args.model)
        ds_config = None if args.config is None else read_config_file(args.config)
        result = plan_cluster(cluster, model=model, ds_config=ds_config, largest=not args.no_largest)
    except ValueError as exc:
        print(f"{parser.prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        print(plan_text(result))
        if args.json:
            _write(args.json, result)
    if args.ds_config:
        _write(args.ds_config, result["ds_config"])
    return 0


def _model_argument(text):
    if text is None:
        return None
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise ValueError(f"--model: not valid JSON: {exc}") from None
    return text


def _write(path, value):
    with open(path, "w") as handle:
        json.dump(value, handle, indent=1)
        handle.write("\n")


def plan_text(result):
    """The plan as text: the question, both sides side by side, each side's ranks, the priors and
    the ds_config to launch with."""
    cluster, model, question = result["cluster"], result["model"], result["question"]
    devices = ", ".join(f"{count} x {kind}" for kind, count in cluster["devices"].items())
    link = "" if cluster["inter_host_gbit_per_s"] is None else f", {cluster['inter_host_gbit_per_s']:g} Gbit/s " \
        "between hosts"
    lines = [f"Plan: {cluster['name']}",
             f"  {cluster['world_size']} ranks on {cluster['hosts']} host(s): {devices}{link}",
             f"  model {model['name']} ({model['source']}): {model['parameters'] / 1e9:.3g} B parameters"
             + (f", {model['layers']} layers" if model["layers"] else ""),
             f"  {question['precision']}, global batch {question['train_batch_size']}, seq_len {question['seq_len']}, "
             f"ZeRO stages tried {question['zero_stages_tried']}", ""]
    upstream, fork = result["upstream"], result["fork"]
    rows = [("ZeRO stage", upstream["zero_stage"], fork["zero_stage"]),
            ("gradient accumulation", upstream["gradient_accumulation_steps"], fork["gradient_accumulation_steps"]),
            ("fits", _yes(upstream), _yes(fork)),
            ("step time", _seconds(upstream.get("step_s")), _seconds(fork.get("step_s"))),
            ("samples/s", _rate(upstream), _rate(fork) + (f" ({result['speedup']:.2f}x)" if result["speedup"] else "")),
            ("compute (slowest rank)", _seconds(upstream.get("compute_s")), _seconds(fork.get("compute_s"))),
            ("communication", _comm(upstream), _comm(fork)),
            ("optimizer (slowest rank)", _seconds(upstream.get("optimizer_s")), _seconds(fork.get("optimizer_s")))]
    largest = result.get("largest_model")
    if largest:
        rows.append(("largest model that fits", _largest(largest["upstream"]), _largest(largest["fork"])))
    lines += format_table(("", "upstream (even split)", "fork"), rows).splitlines()
    for side in (fork, upstream):
        lines += ["", f"Per rank, {side['name']}:"]
        lines += [f"  {problem}" for problem in side["problems"]]
        if side["ranks"]:
            lines += format_table(("ranks", "host", "kind", "micro-batch", "gas", "share", "offload", "peak / capacity",
                                   "phase", "compute"), _rank_rows(side["ranks"])).splitlines()
    lines += ["", "Priors (nothing above was measured on this cluster; how well the plan matched runs on emulated "
              "clusters: docs/planning.md, 'How well'):"]
    lines += [f"  - {note}" for note in result["priors"]]
    lines += ["", "ds_config to launch the fork's choice with (--ds-config OUT writes it):",
              json.dumps(result["ds_config"], indent=1)]
    return "\n".join(lines)


def _rank_rows(ranks):
    """Consecutive ranks with the same row are one row ("0-63")."""
    rows, first = [], 0
    for index, rank in enumerate(ranks):
        row = _rank_row(rank)
        if index + 1 < len(ranks) and _rank_row(ranks[index + 1]) == row:
            continue
        label = str(ranks[first]["rank"]) if first == index else f"{ranks[first]['rank']}-{rank['rank']}"
        rows.append((label, *row))
        first = index + 1
    return rows


def _rank_row(rank):
    offload = rank["offload"] if not rank["offload_fraction"] else f"{rank['offload']} {rank['offload_fraction']:.0%}"
    peak = f"{format_size(rank['predicted_peak_bytes'])} / {format_size(rank['capacity_bytes'])}"
    share = "-" if rank["share"] is None else f"{rank['share']:.4f}"
    return (rank["host"], rank["kind"], rank["micro_batch"], rank["gas"], share, offload, peak,
            rank["peak_phase"] or "-", _seconds(rank["compute_s"]))


def _yes(side):
    return "yes" if side["fits"] else "no"


def _seconds(value):
    if value is None:
        return "-"
    return f"{value:.3g} s" if value >= 0.1 else f"{value * 1e3:.3g} ms"


def _rate(side):
    return "-" if side.get("samples_per_s") is None else f"{side['samples_per_s']:.3g}"


def _comm(side):
    if side.get("communication_s") is None:
        return "-"
    return (f"{_seconds(side['communication_s'])} ({side['communication_share']:.0%} of the step, "
            f"{format_size(side['bytes_per_rank_per_step'])} per rank over the {side['slowest_link']} link)")


def _largest(entry):
    layers = "" if not entry["layers"] else f"{entry['layers']} layers, "
    return f"{layers}{entry['parameters'] / 1e9:.3g} B parameters (ZeRO-{entry['zero_stage']})"
