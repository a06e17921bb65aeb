"""Starting Ray, one rule for every stage.

    ray = init_ray(cfg.ray_address)

`address` set: join that cluster ("auto", "ray://head:10001", ...). Unset: $RAY_ADDRESS when
it is set (what `ray job submit` gives a job's entrypoint), else a private local Ray that
ends with this process. Never Ray's own default of joining whatever cluster `ray start`
last recorded on this machine: that shuts down someone else's Serve on exit.
A local Ray gives every worker one intra-op thread: oversubscribed threads are
catastrophic on a few shared CPU cores.

Joining is checked first: nothing answering at the cluster's address (a stale `ray start`
record, a typo, a head that is gone) raises RayUnreachable within `connect_timeout_s`,
naming the address, instead of ray.init's endless retries.
"""

from __future__ import annotations

import os
import socket
import time

WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def resolve_address(address: str | None) -> str:
    return address or os.environ.get("RAY_ADDRESS") or "local"


class RayUnreachable(ConnectionError):
    """The Ray cluster to join does not answer."""


def cluster_endpoint(address: str) -> tuple[str, int]:
    """host, port to probe for a join address: "auto" (the last `ray start` record on this
    machine), "host:port" (the GCS) or "ray://host:port" (Ray Client, default port 10001)."""
    if address.startswith("ray://"):
        rest = address[len("ray://"):].split("/")[0]
        host, _, port = rest.rpartition(":") if ":" in rest else (rest, "", "10001")
        return host.strip("[]"), int(port)
    if address == "auto":
        from ray._private.services import find_bootstrap_address

        recorded = find_bootstrap_address(None)
        if not recorded:
            raise RayUnreachable("ray_address 'auto': no running cluster recorded on this machine "
                                 "(start one with `ray start --head`, or leave ray_address unset for a local Ray)")
        address = recorded
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"ray_address {address!r}: expected host:port, ray://host:port, 'auto' or 'local'")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Raise RayUnreachable unless something accepts TCP at the address within timeout_s."""
    host, port = cluster_endpoint(address)
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise RayUnreachable(f"ray_address {address!r}: nothing answers at {host}:{port} after {timeout_s:g} s ({last}); "
                         "is the cluster running? (a stale `ray start` record, or leave ray_address and "
                         "$RAY_ADDRESS unset for a private local Ray)")


def init_ray(address: str | None = None, threads: int = 1, connect_timeout_s: float = 10.0, **kwargs):
    """ray.init by the rule above (a no-op when Ray is already up); returns the ray module.
    kwargs go to ray.init for a local Ray only (num_cpus, _temp_dir, log_to_driver, ...)."""
    import ray

    if ray.is_initialized():
        return ray
    address = resolve_address(address)
    if address != "local":
        check_reachable(address, connect_timeout_s)
    if address == "local":
        env = {**WORKER_ENV, "OMP_NUM_THREADS": str(threads), **kwargs.pop("env_vars", {})}
        kwargs = {"include_dashboard": False, "runtime_env": {"env_vars": env}, **kwargs}
        ray.init(address="local", **kwargs)
    else:
        ray.init(address=address)
    return ray
