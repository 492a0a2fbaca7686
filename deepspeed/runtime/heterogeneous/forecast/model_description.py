# SPDX-License-Identifier: Apache-2.0
"""What a model costs before any weight exists: its parameters, largest tensor, compute and
activations per sample, and the same for other depths of its family.

Three ways to name a model:
- a Hugging Face config (a JSON file with ``model_type``): built with ``from_config`` on the meta
  device (no weights, no network) at two layers; the parameters of one layer and of the rest
  (embeddings, head, final norm) give the model at any depth, the given one included;
- one of the repository's own models by name (``REPO_MODELS``: ``examples/tiny_gpt``), counted
  from its shape, as its module builds it;
- plain numbers: ``{"parameters": 7e9, "layers": 32, "hidden": 4096, "seq_len": 2048}``.

Compute and activations are estimates from the shape, not measurements (docs/planning.md):
training costs ``6 * N + 6 * layers * seq_len * hidden`` FLOPs per token (forward and backward of
the matrix multiplications, attention scores included); a layer keeps ``34 * seq_len * hidden``
bytes of 2-byte activations per sample without recomputation (attention computed without storing
its score matrix, as ``scaled_dot_product_attention`` does), and only its input (``2 * seq_len *
hidden``) under activation checkpointing, plus one layer's worth in flight; the logits add ``8 *
seq_len * vocab`` bytes (fp32, and their gradient).
"""

import contextlib
import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Optional

NUMBER_KEYS = ("parameters", "layers", "hidden", "heads", "vocab", "seq_len", "largest_tensor",
               "flops_per_sample", "activation_bytes_per_sample", "name")

# name -> (vocab, seq_len, layers, heads, d_model): examples/tiny_gpt/model.py's GPTConfig sizes.
REPO_MODELS = {
    "tiny_gpt": (256, 128, 4, 4, 128),
    "tiny_gpt.bench": (256, 128, 4, 4, 128),
    "tiny_gpt.demo": (256, 128, 2, 4, 128),
}


@dataclass(frozen=True)
class ModelDescription:
    name: str
    source: str
    """Where the numbers come from: "hf_config <path>", "repository model", "numbers"."""
    layers: int
    """0: unknown (plain numbers without layers); the family then scales by parameters."""
    base_parameters: int
    """Parameters outside the repeated layers (embeddings, head, final norm)."""
    per_layer_parameters: int
    largest_tensor: int
    hidden: int = 0
    heads: int = 0
    vocab: int = 0
    seq_len: int = 0
    flops_override: Optional[float] = None
    activation_override: Optional[float] = None

    @property
    def num_parameters(self):
        return self.base_parameters + self.layers * self.per_layer_parameters

    def with_layers(self, layers):
        """The member of the family with ``layers`` layers (with unknown layers: ``layers`` times
        the parameters, a scale factor). Per-sample overrides scale with the parameters."""
        layers = int(layers)
        if self.layers:
            scale = (self.base_parameters + layers * self.per_layer_parameters) / self.num_parameters
            return replace(self, layers=layers, flops_override=_scaled(self.flops_override, scale),
                           activation_override=_scaled(self.activation_override, layers / self.layers))
        return replace(self, base_parameters=self.base_parameters * layers, largest_tensor=self.largest_tensor,
                       flops_override=_scaled(self.flops_override, layers),
                       activation_override=_scaled(self.activation_override, layers))

    def flops_per_sample(self, seq_len=None):
        if self.flops_override is not None:
            return float(self.flops_override)
        seq = int(seq_len or self.seq_len or 1)
        attention = 6.0 * self.layers * seq * self.hidden if self.hidden else 0.0
        return seq * (6.0 * self.num_parameters + attention)

    def activation_bytes_per_sample(self, seq_len=None, value_bytes=2, checkpointing=False):
        """Estimated activation bytes of one sample (None: not known: the shape was not given)."""
        if self.activation_override is not None:
            return float(self.activation_override)
        if not (self.hidden and self.layers):
            return None
        seq = int(seq_len or self.seq_len or 1)
        scale = value_bytes / 2
        layer = 34.0 * seq * self.hidden * scale
        kept = (2.0 * seq * self.hidden * scale * self.layers + layer) if checkpointing else layer * self.layers
        return kept + 8.0 * seq * self.vocab


def _scaled(value, factor):
    return None if value is None else value * factor


def describe_model(spec, base_dir="."):
    """A ``ModelDescription`` from a cluster file's ``model`` or ``--model``: a path to a Hugging Face
    config JSON, a repository model's name, or a dict (``{"hf_config": path}``, ``{"name": ...}``
    or numbers)."""
    if isinstance(spec, str):
        if spec in REPO_MODELS:
            return repo_model(spec)
        path = spec if os.path.isabs(spec) else os.path.join(base_dir, spec)
        if spec.endswith(".json") or os.path.isfile(path):
            return hf_config_model(path)
        raise ValueError(f"model '{spec}' is neither a Hugging Face config file ({path} not found) nor a "
                         f"repository model ({', '.join(REPO_MODELS)})")
    if isinstance(spec, dict) and set(spec) == {"hf_config"}:
        return describe_model(spec["hf_config"], base_dir)
    if isinstance(spec, dict) and set(spec) == {"name"} and spec["name"] in REPO_MODELS:
        return repo_model(spec["name"])
    if isinstance(spec, dict):
        return numbers_model(spec)
    raise ValueError(f"model must be a Hugging Face config path, one of {', '.join(REPO_MODELS)}, or an object "
                     f"with 'hf_config', or numbers {NUMBER_KEYS}; got {type(spec).__name__}")


def repo_model(name):
    """``examples/tiny_gpt``'s GPT at one of its sizes, counted as ``GPT`` builds it: token and
    position embeddings, per layer two LayerNorms, the attention's qkv and output projections and a
    4x MLP, all with biases; a final LayerNorm; the head tied to the token embedding."""
    vocab, seq_len, layers, heads, d = REPO_MODELS[name]
    return ModelDescription(name=name, source="repository model (examples/tiny_gpt)", layers=layers,
                            base_parameters=vocab * d + seq_len * d + 2 * d,
                            per_layer_parameters=12 * d * d + 13 * d, largest_tensor=max(vocab * d, 4 * d * d),
                            hidden=d, heads=heads, vocab=vocab, seq_len=seq_len)


def numbers_model(values):
    unknown = sorted(set(values) - set(NUMBER_KEYS))
    if unknown or "parameters" not in values:
        raise ValueError(f"model numbers: {'unknown key(s) ' + str(unknown) if unknown else 'missing parameters'}; "
                         f"allowed: {NUMBER_KEYS} (parameters required)")
    for key in NUMBER_KEYS[:-1]:
        if key in values and not (isinstance(values[key], (int, float)) and not isinstance(values[key], bool)
                                  and math.isfinite(values[key]) and values[key] > 0):
            raise ValueError(f"model numbers: {key} = {values[key]!r} must be a positive number")
    total = int(values["parameters"])
    layers = int(values.get("layers", 0))
    return ModelDescription(name=str(values.get("name", "model")), source="numbers", layers=layers,
                            base_parameters=0 if layers else total,
                            per_layer_parameters=total // layers if layers else 0,
                            largest_tensor=int(values.get("largest_tensor", 0)), hidden=int(values.get("hidden", 0)),
                            heads=int(values.get("heads", 0)), vocab=int(values.get("vocab", 0)),
                            seq_len=int(values.get("seq_len", 0)), flops_override=values.get("flops_per_sample"),
                            activation_override=values.get("activation_bytes_per_sample"))


_LAYER_INDEX = re.compile(r"\.(\d+)\.")
BUILT_LAYERS = 2


CACHE_ENV = "DS_HETERO_PLAN_CACHE"
"""Folder of the counted Hugging Face configs (default ``~/.cache/deepspeed-hetero/plan``; empty:
no cache). Importing transformers and building even two layers takes seconds; a count is a pure
function of the config's text and the transformers version."""


def hf_config_model(path, cache_dir=None):
    """Count a Hugging Face model's parameters from its config JSON on the meta device (or read
    the count this config and transformers version got before, ``CACHE_ENV``)."""
    try:
        with open(path) as handle:
            text = handle.read()
        values = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read Hugging Face config {path}: {exc}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"{path}: a Hugging Face config needs 'model_type' (e.g. \"llama\", \"gpt2\")")
    cache = _cache_file(text, cache_dir)
    if cache is not None and os.path.isfile(cache):
        with open(cache) as handle:
            return replace(ModelDescription(**json.load(handle)), name=os.path.basename(path),
                           source=f"hf_config {path}")
    description = _count_hf_model(path, values)
    if cache is not None:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            with open(cache + ".tmp", "w") as handle:
                json.dump(asdict(description), handle)
            os.replace(cache + ".tmp", cache)
    return description


def _cache_file(text, cache_dir):
    folder = cache_dir if cache_dir is not None else os.environ.get(
        CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "deepspeed-hetero", "plan"))
    if not folder:
        return None
    try:
        from importlib.metadata import version
        transformers_version = version("transformers")
    except Exception:  # noqa: BLE001 -- not installed: the build below says so
        return None
    key = hashlib.sha256(f"{transformers_version}\n{text}".encode()).hexdigest()[:32]
    return os.path.join(folder, f"hf-{key}.json")


def _count_hf_model(path, values):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    values = dict(values)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    layers = int(config.num_hidden_layers)
    built = min(layers, BUILT_LAYERS)
    config.num_hidden_layers = built
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total, in_layers, largest = 0, 0, 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        largest = max(largest, parameter.numel())
        if _LAYER_INDEX.search(name):
            in_layers += parameter.numel()
    per_layer = in_layers // built
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    seq_len = int(getattr(config, "max_position_embeddings", 0) or 0)
    return ModelDescription(name=os.path.basename(path), source=f"hf_config {path}", layers=layers,
                            base_parameters=total - in_layers, per_layer_parameters=per_layer,
                            largest_tensor=largest, hidden=hidden,
                            heads=int(getattr(config, "num_attention_heads", 0) or 0),
                            vocab=int(getattr(config, "vocab_size", 0) or 0), seq_len=seq_len)
