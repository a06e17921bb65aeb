"""`dflash serve`, the foreground runner (jobs/serve_run.py), as a user runs it: its own
process and its own Ray, stopped by signals - SIGTERM stops it, SIGINT/SIGTERM drain
in-flight requests, a stale ray_address fails fast naming it; and `serve run` on the
shipped config.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from jobs.demo import free_port

REPO = Path(__file__).resolve().parents[1]


def _wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200:
                return
        except requests.RequestException:  # proxy not up yet, or holding the call until a replica is
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(1)


def _stop(proc: subprocess.Popen, sig: int) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.slow
def test_dflash_serve_runs_in_foreground_and_stops_on_sigterm():
    """run_serve (what `dflash serve` calls) in its own process with its own Ray."""
    port = free_port()
    code = ("from serve.config import load_serve_config; from jobs.serve_run import run_serve; import sys; "
            "run_serve(load_serve_config('serve/config.yaml', sys.argv[1:]))")
    overrides = [f"port={port}", "ray_address=local", "max_replicas=1", "num_cpus_per_replica=0.5"]
    proc = subprocess.Popen([sys.executable, "-c", code, *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, port)
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                          timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        out = _stop(proc, signal.SIGTERM)
        assert proc.returncode == 0 and "shutting down" in out, out
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_serve_run_starts_the_shipped_config(tmp_path):
    """`serve run serve/config.yaml` (port changed: the shipped 8000 may be taken)."""
    port = free_port()
    raw = yaml.safe_load((REPO / "serve" / "config.yaml").read_text())
    raw["http_options"]["port"] = port
    raw["applications"][0]["args"].update(max_replicas=1, num_cpus_per_replica=0.5)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, RAY_ADDRESS="local")  # a fresh Ray, whatever else runs on this machine
    proc = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", str(config)], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(proc, port)
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # drafter: auto, i.e. the reference drafter shipped for the default target
        models = requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
        assert models[0]["drafter"] == "SmolLM2-135M-Instruct", models  # a name, not a server path
        assert models[0]["corpus"] == "SmolLM2-135M-Instruct/corpus/corpus.safetensors", models  # corpus: auto
        _stop(proc, signal.SIGINT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sse_events(r) -> list[str]:
    return [line.decode() for line in r.iter_lines() if line]


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests():
    """SIGTERM to `dflash serve`: streams that can finish within drain_timeout_s finish (their
    last chunk and [DONE]); one that cannot ends with an error event and [DONE]; exit 0."""
    port = free_port()
    code = ("from serve.config import load_serve_config; from jobs.serve_run import run_serve; import sys; "
            "run_serve(load_serve_config('serve/config.yaml', sys.argv[1:]))")
    overrides = [f"port={port}", "max_replicas=1", "num_cpus_per_replica=0.5", "drain_timeout_s=8", "lookup=false",
                 "corpus=none"]
    proc = subprocess.Popen([sys.executable, "-c", code, *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results: dict = {}

    def stream(name, max_tokens, first):
        r = requests.post(f"http://127.0.0.1:{port}/v1/completions", stream=True, timeout=120,
                          json={"prompt": f"Tell me about {name}.", "max_tokens": max_tokens, "temperature": 0,
                                "stream": True, "ignore_eos": name == "the sea"})
        lines = r.iter_lines()
        events = [next(line for line in lines if line).decode()]
        first.set()
        events += [line.decode() for line in lines if line]
        results[name] = events

    try:
        _wait_healthy(proc, port)
        firsts = {n: threading.Event() for n in ("cats", "dogs", "the sea")}
        threads = [threading.Thread(target=stream, args=(n, 2000 if n == "the sea" else 12, firsts[n]))
                   for n in firsts]
        for t in threads:
            t.start()
        for e in firsts.values():
            assert e.wait(120)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0 and "drained" in out, out
        for name in ("cats", "dogs"):
            events = results[name]
            assert events[-1] == "data: [DONE]", events[-3:]
            assert '"finish_reason": "length"' in events[-2] or '"finish_reason": "stop"' in events[-2], events[-3:]
        events = results["the sea"]
        assert events[-1] == "data: [DONE]" and '"code": "shutting_down"' in events[-2], events[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _closed_port() -> int:
    return free_port()  # free: nothing listens there


def test_unreachable_ray_address_fails_fast_with_the_address():
    """A stale or wrong ray_address is refused within the connect timeout, naming it (ray.init
    itself retries forever); "auto" with no cluster recorded says so."""
    from pipelines.ray_session import RayUnreachable, check_reachable

    port = _closed_port()
    t0 = time.time()
    with pytest.raises(RayUnreachable, match=f"127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=2)
    assert time.time() - t0 < 6


@pytest.mark.slow
def test_serve_with_a_stale_ray_address_exits_and_sigterm_stops_the_wait():
    port = _closed_port()
    code = ("from serve.config import load_serve_config; from jobs.serve_run import run_serve; import sys; "
            "run_serve(load_serve_config('serve/config.yaml', sys.argv[1:]))")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", code, f"ray_address=127.0.0.1:{port}", "drafter=none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"nothing answers at 127.0.0.1:{port}" in proc.stderr, proc.stderr[-2000:]
    assert time.time() - t0 < 60
    # a long connect timeout is still cut by SIGTERM
    waiter = subprocess.Popen([sys.executable, "-c", "from pipelines.ray_session import init_ray; "
                               f"print('waiting', flush=True); init_ray('127.0.0.1:{port}', connect_timeout_s=600)"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert waiter.stdout.readline().strip() == "waiting"
        time.sleep(1)
        t1 = time.time()
        waiter.send_signal(signal.SIGTERM)
        waiter.wait(timeout=10)
        assert time.time() - t1 < 10 and waiter.returncode != 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
