"""The serving stage's config: the decoding pair (dflash.pair.DecodeConfig's fields) plus
HTTP, batching, autoscaling and Ray placement. `dflash serve` runs it (jobs/serve_run.py).

One YAML file serves both launchers. serve/config.yaml is a Ray Serve config file (what
`serve run serve/config.yaml` reads: http_options + applications[].import_path/args), and
`load_serve_config` flattens the same file into a `ServeConfig`:

    http_options.host / .port      -> host, port
    applications[0].args           -> every other field
    key=value overrides            -> win over both

A flat YAML of ServeConfig fields (with an optional `stage: serve`) is read as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from dflash.config_file import ConfigError, build_config, load_config, parse_override, read_yaml_mapping
from dflash.pair import DecodeConfig
from dflash.vllm_env import ENGINES

# Keys of a Ray Serve config file that are not ServeConfig fields; Ray reads them, we skip them.
_RAY_ONLY_KEYS = ("proxy_location", "grpc_options", "logging_config", "tracing_config",
                  "controller_options", "target_capacity")


@dataclass(frozen=True)
class ServeConfig(DecodeConfig):
    """Everything a replica and its deployment need. Validated once, passed as an object.

    The decoding fields (target, drafter, dtype, device, verify, block_size, lookup,
    lookup_tokens, corpus, tree_nodes) are DecodeConfig's; the rest are serving's own."""

    STAGE: ClassVar[str] = "serve"

    model_name: str | None = None  # the id /v1/models reports; default: the target id
    # what decodes: "native" (dflash.decoding: lookup, corpus, trees, adaptive width) or
    # "vllm" (vLLM's engine with the drafter, in its own venv: serve/vllm_engine.py)
    engine: Literal["native", "vllm"] = "native"
    vllm_kv_cache_gib: int = 2  # engine vllm on CPU: its KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)
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
    max_body_bytes: int = 1_000_000  # larger request bodies get 413 before any parsing
    prefill_chunk_tokens: int = 256  # prompt tokens prefilled per engine step at most, between decode steps
    prefill_slice_ms: float = 250.0  # while other requests decode, a prefill chunk is only what fits this long (0: no cap)
    prefill_share: float = 0.3  # while other requests decode, prefill takes at most this share of the time (1: every step)
    max_queued_requests: int = 32  # per replica, waiting for a batch slot (and Serve's router queue): 429 beyond
    request_timeout_s: float = 300.0  # queue + generation; past it: 503 (or an error event in a stream)
    drain_timeout_s: float = 30.0  # on SIGINT/SIGTERM: in-flight requests get this long to finish
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
        super().__post_init__()
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.engine == "vllm" and (self.tree_nodes or self.drafter == "random"):
            raise ValueError("engine vllm takes a trained drafter and verifies one chain: tree_nodes and "
                             "drafter=random need engine native")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.prefill_slice_ms < 0:
            raise ValueError(f"prefill_slice_ms must be >= 0, got {self.prefill_slice_ms}")
        if not 0 < self.prefill_share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {self.prefill_share}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
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
