# SPDX-License-Identifier: Apache-2.0
"""A cluster described in a file: hosts, their devices and the links between them.

The file is the question a team asks before it buys or books machines, so it may also name the
model and the training settings (``model``, ``training``, ``ds_config``): the file alone is then a
complete question for ``deepspeed plan``. JSON always; YAML when PyYAML is installed. Example (the
format is in docs/planning.md)::

    {"hosts": [{"name": "a", "devices": [{"kind": "A100-80GB", "count": 4}],
                "intra_host_link": {"gbit_per_s": 2400, "latency_us": 3}},
               {"name": "b", "devices": [{"kind": "RTX-3090", "count": 8}]}],
     "inter_host_link": {"gbit_per_s": 25, "latency_us": 20},
     "model": "llama_7b_config.json", "training": {"train_batch_size": 64, "seq_len": 2048}}

Ranks are numbered host by host, device by device, as the launcher numbers them. Every error names
the key path and what is allowed: a misspelled key is a question answered wrongly, not a default.
"""

import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ..measure.device_table import CPU_SPECS, AcceleratorSpec, find_kind, kind_names

GIB = 2**30

DEFAULT_INTRA_HOST_LINK = {"gbit_per_s": 200.0, "latency_us": 5.0}
"""A host without ``intra_host_link``: PCIe 4.0 x16 between its devices (about 25 GB/s). A prior,
and the report says so."""

TOP_KEYS = ("name", "description", "hosts", "inter_host_link", "model", "training", "ds_config")
HOST_KEYS = ("name", "count", "devices", "intra_host_link", "memory_gb")
DEVICE_KEYS = ("kind", "count", "memory_gb")
KIND_KEYS = ("name", "fp16_tflops", "bf16_tflops", "fp32_tflops", "memory_gb", "memory_bandwidth_gb_s", "cpu")
LINK_KEYS = ("gbit_per_s", "latency_us")
TRAINING_KEYS = ("train_batch_size", "gradient_accumulation_steps", "seq_len", "precision", "zero_stage",
                 "optimizer", "efficiency", "activation_checkpointing", "hbm_utilization_threshold")
PRECISIONS = ("bf16", "fp16", "fp32")


class ClusterDescriptionError(ValueError):
    """A cluster description that cannot be read: the message names the key path."""


@dataclass(frozen=True)
class Link:
    gbit_per_s: float
    latency_us: float
    assumed: bool = False
    """True where the file gave no link and the default (a prior) stands in."""

    @property
    def bytes_per_s(self):
        return self.gbit_per_s * 1e9 / 8


@dataclass(frozen=True)
class RankDevice:
    """One data-parallel rank of the described cluster."""

    rank: int
    host: int
    host_name: str
    spec: AcceleratorSpec
    memory_bytes: int
    from_table: bool
    """The kind's figures come from the datasheet table (else the file gave them as numbers)."""
    cpu: bool = False
    """A CPU rank: its memory is the host's and it trains over gloo (a CPU kind of the table, or a
    kind by numbers with ``"cpu": true``)."""


@dataclass(frozen=True)
class ClusterDescription:
    name: str
    ranks: Tuple[RankDevice, ...]
    host_names: Tuple[str, ...]
    intra_host_links: Tuple[Link, ...]
    """Per host."""
    inter_host_link: Optional[Link]
    host_memory_bytes: Tuple[Optional[int], ...]
    """Per host, its RAM for offloaded optimizer state (None: not given, no limit)."""
    model: object = None
    training: Optional[dict] = None
    ds_config: object = None
    base_dir: str = "."
    """The file's folder: relative paths in ``model`` and ``ds_config`` are read from there."""

    @property
    def world_size(self):
        return len(self.ranks)

    @property
    def hosts(self):
        return [r.host for r in self.ranks]


def load_cluster_file(path):
    """The ``ClusterDescription`` in the JSON or YAML file ``path``."""
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as exc:
        raise ClusterDescriptionError(f"cannot read cluster file {path}: {exc.strerror}") from None
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ClusterDescriptionError(f"{path} is YAML, and PyYAML is not installed: pip install pyyaml, or "
                                          f"write the cluster as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ClusterDescriptionError(f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ClusterDescriptionError(f"{path} is not valid JSON: {exc}") from None
    return parse_cluster(data, base_dir=os.path.dirname(os.path.abspath(path)), source=str(path))


def parse_cluster(data, base_dir=".", source="cluster"):
    """A ``ClusterDescription`` from plain data (a parsed file)."""
    _keys(data, source, TOP_KEYS, ("hosts", ))
    hosts = data["hosts"]
    if not isinstance(hosts, list) or not hosts:
        raise ClusterDescriptionError(f"{source}: hosts must be a non-empty list of hosts, each with {HOST_KEYS}")
    ranks, names, links, memories = [], [], [], []
    for index, host in enumerate(hosts):
        where = f"{source}: hosts[{index}]"
        _keys(host, where, HOST_KEYS, ("devices", ))
        count = _count(host.get("count", 1), f"{where}.count")
        devices = host["devices"]
        if not isinstance(devices, list) or not devices:
            raise ClusterDescriptionError(f"{where}.devices must be a non-empty list of {{kind, count, memory_gb}}")
        parsed = [_device(device, f"{where}.devices[{d}]") for d, device in enumerate(devices)]
        link = _link(host.get("intra_host_link"), f"{where}.intra_host_link")
        memory = host.get("memory_gb")
        memory = None if memory is None else int(_positive(memory, f"{where}.memory_gb") * GIB)
        for copy in range(count):
            name = str(host.get("name", f"host{index}")) + (f"-{copy}" if count > 1 else "")
            host_index = len(names)
            names.append(name)
            links.append(link)
            memories.append(memory)
            for spec, device_count, memory_bytes, from_table, cpu in parsed:
                for _ in range(device_count):
                    ranks.append(RankDevice(len(ranks), host_index, name, spec, memory_bytes, from_table, cpu))
    inter = data.get("inter_host_link")
    if len(names) > 1 and inter is None:
        raise ClusterDescriptionError(f"{source}: inter_host_link is required with {len(names)} hosts: "
                                      f"{{\"gbit_per_s\": ..., \"latency_us\": ...}} (25 GbE: 25)")
    training = data.get("training")
    if training is not None:
        _training(training, f"{source}: training")
    return ClusterDescription(name=str(data.get("name", os.path.basename(str(source)))), ranks=tuple(ranks),
                              host_names=tuple(names), intra_host_links=tuple(links),
                              inter_host_link=None if inter is None else _link(inter, f"{source}: inter_host_link"),
                              host_memory_bytes=tuple(memories), model=data.get("model"), training=training,
                              ds_config=data.get("ds_config"), base_dir=base_dir)


def _device(device, where):
    _keys(device, where, DEVICE_KEYS, ("kind", ))
    kind = device["kind"]
    if isinstance(kind, str):
        spec = find_kind(kind)
        if spec is None:
            raise ClusterDescriptionError(f"{where}.kind: '{kind}' is not a known device kind; known: "
                                          f"{', '.join(kind_names())}; or give the kind by numbers: {KIND_KEYS}")
        from_table, cpu = True, spec in CPU_SPECS
    elif isinstance(kind, dict):
        spec, from_table = _kind_by_numbers(kind, f"{where}.kind"), False
        cpu = kind.get("cpu", False)
        if not isinstance(cpu, bool):
            raise ClusterDescriptionError(f"{where}.kind.cpu = {cpu!r} must be true or false (true: a CPU rank, "
                                          "whose memory is the host's, over gloo)")
    else:
        raise ClusterDescriptionError(f"{where}.kind must be a kind's name ({', '.join(kind_names()[:4])}, ...) "
                                      f"or an object with {KIND_KEYS}")
    memory_gb = device.get("memory_gb", spec.memory_gb)
    if device.get("memory_gb") is None and not spec.memory_gb:
        raise ClusterDescriptionError(f"{where}.memory_gb is required for kind '{spec.kind}' (a CPU rank's share "
                                      f"of its host's RAM)")
    memory_bytes = int(_positive(memory_gb, f"{where}.memory_gb") * GIB)
    return spec, _count(device.get("count", 1), f"{where}.count"), memory_bytes, from_table, cpu


def _kind_by_numbers(kind, where):
    _keys(kind, where, KIND_KEYS, ("name", "fp32_tflops", "memory_gb"))
    rates = {key: float(kind.get(key, 0.0)) for key in ("fp16_tflops", "bf16_tflops")}
    for key, value in rates.items():
        if not (math.isfinite(value) and value >= 0):
            raise ClusterDescriptionError(f"{where}.{key} = {kind.get(key)!r} must be a number >= 0 (0: no such "
                                          "arithmetic)")
    bandwidth = kind.get("memory_bandwidth_gb_s")
    return AcceleratorSpec(name=str(kind["name"]), aliases=(), form_factor="", fp16_tflops=rates["fp16_tflops"],
                           bf16_tflops=rates["bf16_tflops"],
                           fp32_tflops=_positive(kind["fp32_tflops"], f"{where}.fp32_tflops"),
                           memory_gb=_positive(kind["memory_gb"], f"{where}.memory_gb"),
                           bandwidth_gbps=0.0 if bandwidth is None else _positive(
                               bandwidth, f"{where}.memory_bandwidth_gb_s"),
                           kind=str(kind["name"]))


def _link(link, where):
    if link is None:
        return Link(**DEFAULT_INTRA_HOST_LINK, assumed=True)
    _keys(link, where, LINK_KEYS, ("gbit_per_s", ))
    latency = link.get("latency_us", 0.0)
    if not (isinstance(latency, (int, float)) and not isinstance(latency, bool) and math.isfinite(latency)
            and latency >= 0):
        raise ClusterDescriptionError(f"{where}.latency_us = {latency!r} must be a number >= 0 (microseconds)")
    return Link(_positive(link["gbit_per_s"], f"{where}.gbit_per_s"), float(latency))


def _training(training, where):
    _keys(training, where, TRAINING_KEYS, ())
    for key in ("train_batch_size", "gradient_accumulation_steps", "seq_len"):
        if key in training:
            _count(training[key], f"{where}.{key}")
    if training.get("precision", "bf16") not in PRECISIONS:
        raise ClusterDescriptionError(f"{where}.precision = {training['precision']!r}; allowed: {PRECISIONS}")
    if training.get("zero_stage", "auto") not in (0, 1, 2, 3, "auto"):
        raise ClusterDescriptionError(f"{where}.zero_stage = {training['zero_stage']!r}; allowed: 0, 1, 2, 3, "
                                      "\"auto\"")
    for key in ("efficiency", "hbm_utilization_threshold"):
        if key in training and not 0 < _positive(training[key], f"{where}.{key}") <= 1:
            raise ClusterDescriptionError(f"{where}.{key} = {training[key]!r} must be in (0, 1]")


def _keys(value, where, allowed, required):
    if not isinstance(value, dict):
        raise ClusterDescriptionError(f"{where} must be an object with keys {allowed}, not {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ClusterDescriptionError(f"{where}: unknown key(s) {unknown}; allowed: {allowed}")
    missing = [key for key in required if key not in value]
    if missing:
        raise ClusterDescriptionError(f"{where}: missing key(s) {missing}; allowed: {allowed}")


def _positive(value, where):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ClusterDescriptionError(f"{where} = {value!r} must be a positive number")
    return float(value)


def _count(value, where):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterDescriptionError(f"{where} = {value!r} must be a whole number >= 1")
    return value
