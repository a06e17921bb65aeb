"""Shared fixtures: one Ray session per test run, the default target loaded once.

Environment for offline, CPU-only, quiet runs is set here so `pytest` alone works too.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

torch.set_num_threads(1)

_RAY_TMP = tempfile.mkdtemp(prefix="dflash-ray-tests-")


@pytest.fixture(scope="session")
def target_fp32():
    """The real default target (SmolLM2-135M-Instruct), fp32, CPU. Converted once, cached."""
    from dflash.target import load_target

    return load_target("default", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def target_bf16():
    from dflash.target import load_target

    return load_target("default", device="cpu", dtype="bf16")


def start_local_ray():
    """The one local Ray session of the test run (restarted if a test had to shut it down,
    e.g. to build a multi-node ray.cluster_utils.Cluster)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=4,  # logical CPUs: actors ask for fractions of these
            include_dashboard=False,
            _temp_dir=_RAY_TMP,
            object_store_memory=int(1e9),
            log_to_driver=False,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                      "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}},
        )
    return ray


@pytest.fixture
def ray_session():
    return start_local_ray()


def pytest_sessionfinish(session, exitstatus):
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    except Exception:
        pass
