"""Starting Ray, one rule for every stage.

    ray = init_ray(cfg.ray_address)

`address` set: join that cluster ("auto", "ray://head:10001", ...). Unset: $RAY_ADDRESS when
it is set (what `ray job submit` gives a job's entrypoint), else a private local Ray that
ends with this process. Never Ray's own default of joining whatever cluster `ray start`
last recorded on this machine: that shuts down someone else's Serve on exit.
A local Ray gives every worker one intra-op thread: oversubscribed threads are
catastrophic on a few shared CPU cores.
"""

from __future__ import annotations

import os

WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def resolve_address(address: str | None) -> str:
    return address or os.environ.get("RAY_ADDRESS") or "local"


def init_ray(address: str | None = None, threads: int = 1, **kwargs):
    """ray.init by the rule above (a no-op when Ray is already up); returns the ray module.
    kwargs go to ray.init for a local Ray only (num_cpus, _temp_dir, log_to_driver, ...)."""
    import ray

    if ray.is_initialized():
        return ray
    address = resolve_address(address)
    if address == "local":
        env = {**WORKER_ENV, "OMP_NUM_THREADS": str(threads), **kwargs.pop("env_vars", {})}
        kwargs = {"include_dashboard": False, "runtime_env": {"env_vars": env}, **kwargs}
        ray.init(address="local", **kwargs)
    else:
        ray.init(address=address)
    return ray
