# SPDX-License-Identifier: Apache-2.0
"""``heterogeneous_config.communication``: defaults, accepted values, errors that name the key
path and the allowed values, and its part in the settings every rank must agree on."""

import pytest

from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings, settings_summary


def parse(communication, enabled=True):
    config = {"heterogeneous_config": {"enabled": enabled, "communication": communication}}
    return load_heterogeneous_settings(config, environ={}).config.communication


def error_of(communication):
    with pytest.raises(ValueError) as info:
        parse(communication)
    return str(info.value)


def test_defaults_are_auto_and_uncompressed():
    communication = load_heterogeneous_settings({}, environ={}).config.communication
    assert communication.hierarchical_reduction == "auto"
    assert communication.compress_inter_host is False
    assert communication.link_aware_buckets == "auto"


@pytest.mark.parametrize("value", ["auto", True, False])
def test_hierarchical_reduction_takes_auto_true_false(value):
    assert parse({"hierarchical_reduction": value}).hierarchical_reduction == value


@pytest.mark.parametrize("value", ["auto", True, False])
def test_link_aware_buckets_takes_auto_true_false(value):
    assert parse({"link_aware_buckets": value}).link_aware_buckets == value


@pytest.mark.parametrize("value", [False, None, "bf16", "fp16"])
def test_compression_takes_false_bf16_fp16(value):
    assert parse({"compress_inter_host": value}).compress_inter_host == (value or False)


@pytest.mark.parametrize("communication, expected", [
    ({"hierarchical_reduction": "yes"},
     "heterogeneous_config.communication.hierarchical_reduction: 'yes' is not allowed; use true, false or \"auto\""),
    ({"hierarchical_reduction": 1},
     "heterogeneous_config.communication.hierarchical_reduction: 1 is not allowed; use true, false or \"auto\""),
    ({"compress_inter_host": "int8"},
     "heterogeneous_config.communication.compress_inter_host: 'int8' is not allowed; use false, \"lossless\" (exact), "
     "\"bf16\" or \"fp16\""),
    ({"compress_inter_host": True},
     "heterogeneous_config.communication.compress_inter_host: True is not allowed; use false, \"lossless\" (exact), "
     "\"bf16\" or \"fp16\""),
    ({"hierarchical": True},
     "heterogeneous_config.communication.hierarchical: unknown key 'hierarchical'; did you mean 'hierarchical_reduction'? allowed keys: compress_inter_host, "
     "hierarchical_reduction, link_aware_buckets"),
    ({"link_aware_buckets": "on"},
     "heterogeneous_config.communication.link_aware_buckets: 'on' is not allowed; use true, false or \"auto\""),
    ({"hierarchical_reduction": False, "compress_inter_host": "bf16"},
     "heterogeneous_config.communication: compress_inter_host 'bf16' compresses the inter-host step of the "
     "hierarchical reduction, which hierarchical_reduction false turns off"),
])
def test_bad_values_name_the_key_path_and_what_is_allowed(communication, expected):
    assert expected in error_of(communication)


def test_block_must_be_an_object():
    # (A bare "auto" is dropped by DeepSpeedConfigModel, as for every block: the defaults apply.)
    with pytest.raises(ValueError, match="heterogeneous_config.communication: Input should be a valid dictionary"):
        parse("hierarchical")
    assert parse("auto").hierarchical_reduction == "auto"


def test_ranks_must_agree_on_it():
    """The block is part of the settings the ranks compare at start-up: a rank that turned the
    hierarchical reduction off would create no groups while its peers wait in theirs."""
    config = {"heterogeneous_config": {"enabled": True, "communication": {"hierarchical_reduction": False}}}
    flat = settings_summary(load_heterogeneous_settings(config, environ={}), environ={})["settings"]
    assert flat["heterogeneous_config.communication.hierarchical_reduction"] is False
    assert flat["heterogeneous_config.communication.compress_inter_host"] is False
    assert flat["heterogeneous_config.communication.link_aware_buckets"] == "auto"
