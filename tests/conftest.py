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

import sys

import pytest
import torch

torch.set_num_threads(1)  # 2 shared cores: oversubscribed threads are catastrophic
sys.path.insert(0, os.path.dirname(__file__))  # tests/support.py

_RAY_TMP = tempfile.mkdtemp(prefix="dflash-ray-tests-")
# ray.cluster_utils.Cluster (the multi-node tests) writes an address file into Ray's default
# temp dir without creating it; on a fresh machine nothing else has made /tmp/ray yet.
os.makedirs(os.path.join(tempfile.gettempdir(), "ray"), exist_ok=True)


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
    from pipelines.ray_session import init_ray

    return init_ray("local",
                    num_cpus=4,  # logical CPUs: actors ask for fractions of these
                    _temp_dir=_RAY_TMP, object_store_memory=int(1e9), log_to_driver=False,
                    env_vars={"DS_ACCELERATOR": "cpu"})


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


@pytest.fixture(scope="session")
def prompts(target_fp32):
    """The chat prompts as token ids (ragged lengths: left padding in a batch)."""
    from support import CHAT_PROMPTS, chat_prompt_ids

    return chat_prompt_ids(target_fp32, CHAT_PROMPTS)


@pytest.fixture(scope="session")
def reference(target_fp32, prompts):
    """transformers' greedy outputs (fp32, GREEDY_TOKENS each): what lossless decoding must equal."""
    from support import GREEDY_TOKENS, hf_greedy

    return [hf_greedy(target_fp32, p, GREEDY_TOKENS) for p in prompts]


@pytest.fixture(scope="session")
def trained(target_fp32):
    """A drafter trained briefly (~1 min) to memorise the target's greedy answers to four
    chat prompts: (drafter, history, prompts, outputs)."""
    from support import CHAT_PROMPTS, chat_prompt_ids, train_memorising_drafter

    prompts = chat_prompt_ids(target_fp32, CHAT_PROMPTS[:4])
    drafter, history, outputs = train_memorising_drafter(target_fp32, prompts)
    return drafter, history, prompts, outputs
