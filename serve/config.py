"""The serving stage's config, and the foreground runner behind `dflash serve`.

One YAML file serves both launchers. serve/config.yaml is a Ray Serve config file (what
`serve run serve/config.yaml` reads: http_options + applications[].import_path/args), and
`load_serve_config` flattens the same file into a `ServeConfig`:

    http_options.host / .port      -> host, port
    applications[0].args           -> every other field
    key=value overrides            -> win over both

A flat YAML of ServeConfig fields (with an optional `stage: serve`) is read as well.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal


from jobs.config import ConfigError, build_config, load_config, parse_override, read_yaml_mapping

# Keys of a Ray Serve config file that are not ServeConfig fields; Ray reads them, we skip them.
_RAY_ONLY_KEYS = ("proxy_location", "grpc_options", "logging_config", "tracing_config",
                  "controller_options", "target_capacity")


@dataclass(frozen=True)
class ServeConfig:
    """Everything a replica and its deployment need. Validated once, passed as an object."""

    STAGE: ClassVar[str] = "serve"

    # the model pair
    target: str = "default"  # "default", a Hugging Face directory or a .gguf file
    # a directory; "default": the reference drafter shipped for the target; "auto": that one
    # when the target has one, else none; None/"none": autoregressive
    drafter: str | None = "auto"
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    device: str = "cpu"  # "cpu" or "cuda"
    verify: Literal["rejection", "match"] = "rejection"
    lookup: bool = True  # with a drafter: copy drafts from the context when it repeats (dflash.lookup)
    lookup_tokens: int = 7  # tokens per copied or corpus draft
    # corpus lookup (dflash.corpus): "auto" = the drafter directory's corpus/corpus.safetensors
    # when it has one; "none"/None = off; or a file made by `dflash corpus`
    corpus: str | None = "auto"
    # > 0: verify a draft tree of up to this many tokens a cycle (dflash.tree); 0: one draft
    tree_nodes: int = 0
    model_name: str | None = None  # the id /v1/models reports; default: the target id
    # HTTP
    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "dflash"
    route_prefix: str = "/"
    api_keys_file: str | None = None  # one key per line; '#' comments
    api_keys_env: str | None = None  # name of an env var holding comma-separated keys
    # batching and limits
    max_batch_size: int = 8
    max_ongoing_requests: int = 16  # per replica; Serve queues the rest
    default_max_tokens: int = 256
    max_context_tokens: int | None = None  # context budget; default: the target's
    # replicas and autoscaling
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    num_cpus_per_replica: float = 1.0
    num_gpus_per_replica: float = 0.0
    torch_threads: int = 1  # intra-op threads per replica: oversubscription is catastrophic on CPU
    # Ray
    ray_address: str | None = None  # None: start a local Ray; "auto": join the running cluster

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {self.lookup_tokens}")
        if self.tree_nodes < 0 or self.tree_nodes == 1:
            raise ValueError(f"tree_nodes must be 0 (off) or >= 2, got {self.tree_nodes}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                             f"got {self.min_replicas}..{self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas {self.initial_replicas} outside {self.min_replicas}..{self.max_replicas}")
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests must be > 0, got {self.target_ongoing_requests}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("upscale_delay_s and downscale_delay_s must be >= 0")
        if self.num_cpus_per_replica < 0 or self.num_gpus_per_replica < 0:
            raise ValueError("num_cpus_per_replica and num_gpus_per_replica must be >= 0")
        if self.device.startswith("cuda") and self.num_gpus_per_replica <= 0:
            raise ValueError("device cuda needs num_gpus_per_replica > 0")
        if self.torch_threads < 1:
            raise ValueError(f"torch_threads must be >= 1, got {self.torch_threads}")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {self.route_prefix!r}")


def flatten_serve_file(raw: dict, source: str = "config") -> dict:
    """A Ray Serve config file's mapping -> ServeConfig values (see the module docstring)."""
    if "applications" not in raw:
        return dict(raw)
    apps = raw.get("applications") or []
    if len(apps) != 1 or not isinstance(apps[0], dict):
        raise ConfigError(f"{source}: expected exactly one application, got {len(apps)}")
    app = apps[0]
    values = dict(app.get("args") or {})
    http = raw.get("http_options") or {}
    for key in ("host", "port"):
        if key in http:
            values.setdefault(key, http[key])
    if "name" in app:
        values.setdefault("app_name", app["name"])
    if app.get("route_prefix"):
        values.setdefault("route_prefix", app["route_prefix"])
    for key, value in raw.items():
        if key not in ("applications", "http_options", *_RAY_ONLY_KEYS):
            values.setdefault(key, value)
    return values


def load_serve_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ServeConfig:
    """Read serve/config.yaml (Ray Serve layout or flat), apply key=value overrides."""
    if path is None:
        return load_config(ServeConfig, None, list(overrides))
    path = Path(path)
    raw = read_yaml_mapping(path)
    values = flatten_serve_file(raw, str(path))
    stage = values.pop("stage", None)
    if stage is not None and stage != ServeConfig.STAGE:
        raise ConfigError(f"{path} is a config for stage '{stage}', not '{ServeConfig.STAGE}'")
    for item in overrides:
        key, value = parse_override(item)
        values[key] = value
    return build_config(ServeConfig, values, str(path))


def run_serve(cfg: ServeConfig, ready: threading.Event | None = None, stop: threading.Event | None = None) -> None:
    """Start Ray (or join `ray_address`) and the app; block until SIGINT/SIGTERM (or `stop`).

    Shuts Serve and Ray down on the way out, whatever ended the wait. `ready` is set once
    the application is running (for callers that drive it from another thread).
    """
    import ray
    from ray import serve

    from dflash.checkpoint import is_drafter_directory_spec
    from serve.app import build_app

    if cfg.ray_address is None and is_drafter_directory_spec(cfg.drafter) and not Path(cfg.drafter).expanduser().exists():
        # a local Ray: the replica would run here and fail to start on a missing drafter
        raise FileNotFoundError(f"drafter directory not found: {cfg.drafter}")
    stop = stop or threading.Event()
    previous = {}
    started_ray = not ray.is_initialized()
    try:
        if started_ray:
            ray.init(address=cfg.ray_address, runtime_env={"env_vars": {
                "OMP_NUM_THREADS": str(cfg.torch_threads), "TOKENIZERS_PARALLELISM": "false"}})
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        # after ray.init, which installs its own fatal-signal handler (SIGTERM would abort)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=False)
        print(f"dflash serve: {cfg.app_name} at http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}/v1 "
              f"(Ctrl-C to stop)", flush=True)
        if ready is not None:
            ready.set()
        while not stop.wait(0.5):
            pass
        print("dflash serve: shutting down", flush=True)
    finally:
        try:
            serve.shutdown()
        finally:
            if started_ray:
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
