"""`dflash serve`: run the Serve application in the foreground until SIGINT/SIGTERM.

    dflash serve --config serve/config.yaml [key=value ...]

The application itself (serve/app.py) knows nothing of processes or signals; this runner
starts Ray and Serve, installs the signal handlers and shuts both down on the way out.

Shutdown drains: the first SIGINT/SIGTERM posts a deadline (now + drain_timeout_s) in Ray's
KV store, which every replica polls; replicas then refuse new requests (503 + Retry-After),
let in-flight ones finish, and at the deadline end what still runs with an error (an
error event and [DONE] in a stream, 503 otherwise). The app is deleted while the HTTP
proxies still run, so finished answers reach their clients; then Serve and Ray stop.
A second signal skips the rest of the drain.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from serve.config import ServeConfig


def run_serve(cfg: ServeConfig, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Start Ray (pipelines.ray_session's rule: a private local Ray unless `ray_address` or
    $RAY_ADDRESS names a cluster) and the app; block until SIGINT/SIGTERM (or `stop`).

    Shuts Serve and Ray down on the way out, whatever ended the wait. `ready` is set once
    the application is running (for callers that drive it from another thread).
    """
    import ray
    from ray import serve

    from dflash.checkpoint import is_drafter_directory_spec
    from dflash.pair import DecodeConfig, check_pair
    from pipelines.ray_session import init_ray
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    from serve.app import build_app, drain_key

    if cfg.ray_address is None and is_drafter_directory_spec(cfg.drafter) and not Path(cfg.drafter).expanduser().exists():
        # a local Ray: the replica would run here and fail to start on a missing drafter
        raise FileNotFoundError(f"drafter directory not found: {cfg.drafter}")
    check_pair(DecodeConfig.of(cfg))  # a pair that cannot work is refused before Ray starts
    if cfg.engine == "vllm" and cfg.ray_address is None:
        from dflash.vllm_env import vllm_python

        vllm_python()  # FileNotFoundError: no vLLM venv here, refused before Ray starts
    stop = stop or threading.Event()
    previous = {}
    started_ray = not ray.is_initialized()
    try:
        if started_ray:
            init_ray(cfg.ray_address, threads=cfg.torch_threads)  # unset: a private local Ray
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        # after ray.init, which installs its own fatal-signal handler (SIGTERM would abort)
        if threading.current_thread() is threading.main_thread():
            def on_signal(signum, frame):
                if stop.is_set():  # a second signal: stop draining now
                    raise KeyboardInterrupt
                stop.set()

            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        _internal_kv_del(drain_key(cfg.app_name))  # a crashed runner's deadline must not drain this app
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
        print(f"dflash serve: {cfg.app_name} at http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1 "
              f"(Ctrl-C to stop)", flush=True)
        if ready is not None:
            ready.set()
        while not stop.wait(0.5):
            pass
        print(f"dflash serve: shutting down (draining in-flight requests, up to {cfg.drain_timeout_s:g} s)",
              flush=True)
        _internal_kv_put(drain_key(cfg.app_name), str(time.time() + cfg.drain_timeout_s).encode(), overwrite=True)
        serve.delete(cfg.app_name)  # replicas finish or cut their requests first; the proxies still answer
        _internal_kv_del(drain_key(cfg.app_name))
        print("dflash serve: drained", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
