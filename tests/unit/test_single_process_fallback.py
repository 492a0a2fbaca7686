# SPDX-License-Identifier: Apache-2.0
"""`python train.py` with no launcher and no mpi4py runs as one process; launched ranks are left alone."""

import logging
from unittest import mock

import pytest

from deepspeed.runtime.heterogeneous.cli import launcher
from deepspeed.utils import logger


@pytest.fixture
def no_mpi4py():
    with mock.patch.object(launcher.importlib.util, "find_spec", return_value=None):
        yield


def test_no_launcher_sets_one_process_group(no_mpi4py):
    environ = {"PATH": "/bin"}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert launcher.single_process_fallback(environ) is True
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert environ["RANK"] == "0" and environ["WORLD_SIZE"] == "1" and environ["LOCAL_RANK"] == "0"
    assert environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(environ["MASTER_PORT"]) < 65536
    assert len(records) == 1 and "single process" in records[0].getMessage()


def test_user_master_address_and_port_are_kept(no_mpi4py):
    environ = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29511"}
    assert launcher.single_process_fallback(environ) is True
    assert environ["MASTER_ADDR"] == "10.0.0.5" and environ["MASTER_PORT"] == "29511"


@pytest.mark.parametrize("environ", [{"RANK": "1"}, {"WORLD_SIZE": "2"}, {"LOCAL_RANK": "0"},
                                     {"OMPI_COMM_WORLD_SIZE": "4"}, {"PMI_SIZE": "2"}, {"SLURM_STEP_NUM_TASKS": "8"}])
def test_a_launched_rank_goes_to_upstream_discovery(no_mpi4py, environ):
    before = dict(environ)
    assert launcher.single_process_fallback(environ) is False
    assert environ == before


def test_a_one_process_mpi_world_without_mpi4py_runs_alone(no_mpi4py):
    assert launcher.single_process_fallback({"OMPI_COMM_WORLD_SIZE": "1"}) is True


def test_with_mpi4py_upstream_discovers_through_mpi():
    environ = {}
    with mock.patch.object(launcher.importlib.util, "find_spec", return_value=object()):
        assert launcher.single_process_fallback(environ) is False
    assert environ == {}
