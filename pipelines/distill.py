"""Distillation on Ray Data: prompts -> target-regenerated responses + tapped hidden states.

    dflash distill --config jobs/configs/distill.yaml [key=value ...]

The driver (this module) is cheap and deterministic; the heavy work runs in a Ray Data
actor pool (pipelines/distill_worker.py):

1. Check the configuration before any work: target resolvable, tapped layer ids in range,
   output directory writable. Only the tokenizer and config are loaded here, never the
   weights, so the driver can run on a CPU-only head node.
2. Plan: stream the source, normalise each record, split train/held-out by sample id,
   drop duplicates, reject what cannot be distilled (malformed, empty, non-text, first
   prompt over the context budget) into _rejects.jsonl, stop after `limit` accepted
   samples. The plan is a pure function of the config and the source files.
3. Cut the plan into shards of `shard_size` consecutive samples: shard i is always
   part-<i>.parquet. Shards already on disk are skipped, the rest go through the pool.
   Rerunning with a larger `limit` extends the dataset: only the new shards (and a last
   shard that was short) are computed.
   Each shard file appears by atomic rename, so after any crash (actor, node or driver)
   a rerun computes exactly the missing shards and no reader ever sees a partial file.
4. Check exactly-once (every planned sample id once, nothing else) and write
   _manifest.json last.

A run fingerprint (everything that decides the content) is kept in _run.json; a rerun
into a directory made with other settings is refused rather than mixed. Every check and
the whole plan come before the first write: a refused run (other settings, a source that
cannot be read, a lowered limit) changes no file in output_dir.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import pyarrow.parquet as pq

from dflash.data import (DUPLICATE, EMPTY, FORMAT_VERSION, MANIFEST_NAME, REJECTS_NAME, TOO_LONG, DatasetMetadata,
                         Reject, normalize_conversation, prompt_turns, raw_record_id, sample_id, shard_files,
                         shard_name, split_of)
from dflash.regenerate import GenerationParams, chat_prompt_ids
from dflash.sources import SourceError, Unparsable, iter_records, resolve_source
from dflash.teacher_forcing import source_messages

RUN_NAME = "_run.json"


class DistillConfigError(ValueError):
    """Bad distillation settings, found before any work starts."""


@dataclass(frozen=True)
class DistillConfig:
    """Defaults fit the tiny default target on 2 CPU cores (a ~1-2 minute run).

    dtype defaults to fp32 on CPU: batched greedy tokens then equal one-at-a-time greedy
    tokens exactly, and at this model size bf16 measured no faster here. Use bf16 on GPU.
    """

    STAGE: ClassVar[str] = "distill"

    # what to distill
    target: str = "default"
    source: str = "sharegpt"  # "sharegpt" (the wheel), or a .json / .jsonl / .parquet path
    split: Literal["train", "heldout", "all"] = "train"
    heldout_fraction: float = 0.02
    limit: int = 64  # accepted samples; 0 = the whole split
    # "regenerated": the target writes every reply (the default); "source": the source's own
    # replies, teacher-forced, labelled with the target's greedy tokens (dflash/teacher_forcing.py:
    # ~40x cheaper per token on a CPU; max_new_tokens is then only the room the first prompt
    # must leave, and sequences are cut at max_seq_len)
    responses: Literal["regenerated", "source"] = "regenerated"
    # generation
    max_new_tokens: int = 128
    max_turns: int = 2
    max_seq_len: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    thinking: bool | None = None
    seed: int = 0
    # features
    # what writes the responses: "native" (our decode loop) or "vllm" (vLLM in its own venv,
    # pipelines/vllm_generate.py); the features are our teacher-forced pass either way
    engine: Literal["native", "vllm"] = "native"
    features: Literal["taps", "none"] = "taps"
    num_taps: int = 5
    target_layer_ids: tuple[int, ...] | None = None  # default: the paper's spread of num_taps
    # how: batching, sharding, pool, hardware
    batch_size: int = 8  # conversations per generate call inside an actor
    shard_size: int = 16  # samples per output file (the unit of resume)
    num_actors: int = 1  # fixed pool size ...
    min_actors: int | None = None  # ... or an autoscaling pool (set both)
    max_actors: int | None = None
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float = 0.0
    dtype: str = "fp32"
    device: str = "cpu"
    output_dir: str = "outputs/distill"
    ray_address: str | None = None  # None: RAY_ADDRESS if set (ray job submit), else a local Ray
    progress: bool = True

    def __post_init__(self):
        for name in ("batch_size", "shard_size", "num_actors", "num_taps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit < 0:
            raise ValueError(f"limit must be >= 0 (0 = all), got {self.limit}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if (self.min_actors is None) != (self.max_actors is None):
            raise ValueError("set both min_actors and max_actors for an autoscaling pool, or neither")
        if self.min_actors is not None and not 1 <= self.min_actors <= self.max_actors:
            raise ValueError(f"need 1 <= min_actors <= max_actors, got {self.min_actors}, {self.max_actors}")
        if self.num_cpus_per_actor <= 0 or self.num_gpus_per_actor < 0:
            raise ValueError("num_cpus_per_actor must be > 0 and num_gpus_per_actor >= 0")
        if self.device.startswith("cuda") and self.num_gpus_per_actor <= 0:
            raise ValueError("device cuda needs num_gpus_per_actor > 0 (Ray hides GPUs from actors without one)")
        from dflash.target import parse_dtype

        parse_dtype(self.dtype)
        self.generation()  # validates the generation fields
        from dflash.vllm_env import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if self.engine == "vllm" and self.top_k:
            raise ValueError("engine vllm does not take top_k here; use engine native")
        from dflash.data import RESPONSES

        if self.responses not in RESPONSES:
            raise ValueError(f"unknown responses {self.responses!r}: use one of {', '.join(RESPONSES)}")
        if self.responses == "source" and (self.temperature or self.engine != "native"):
            raise ValueError("responses source labels replies with the target's greedy tokens in one teacher-forced "
                             "pass: it takes temperature 0 and engine native")

    def generation(self) -> GenerationParams:
        return GenerationParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, max_turns=self.max_turns,
                                max_seq_len=self.max_seq_len, thinking=self.thinking)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


# --- start-up checks -------------------------------------------------------------------------

def inspect_target(spec: str):
    """dflash.target.inspect_target, with a bad spec reported as a config error."""
    from dflash.target import inspect_target as inspect

    try:
        return inspect(spec)
    except (ValueError, FileNotFoundError) as e:
        raise DistillConfigError(f"target: {e}") from e


def tapped_layers(cfg: DistillConfig, num_layers: int) -> tuple[int, ...]:
    from dflash.config import default_target_layer_ids

    if cfg.features == "none":
        return ()
    ids = tuple(cfg.target_layer_ids) if cfg.target_layer_ids else tuple(default_target_layer_ids(num_layers, cfg.num_taps))
    bad = [l for l in ids if not 0 <= l < num_layers]
    if bad:
        raise DistillConfigError(f"target_layer_ids {bad} out of range: the target has {num_layers} layers "
                                 f"(valid ids 0..{num_layers - 1})")
    return ids


def prepare_output_dir(path: str) -> Path:
    out = Path(path).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise DistillConfigError(f"output_dir {out} is not writable: {e}") from e
    for stale in out.glob(".*.tmp-*"):  # temporary files of a crashed run (never read)
        stale.unlink(missing_ok=True)
    return out


# --- planning ---------------------------------------------------------------------------------

@dataclass
class Plan:
    samples: list[dict]  # {"sample_id", "system", "users"} (+ "messages" for source replies) in source order
    rejects: list[dict]  # {"index", "sample_id", "reason", "detail"} in source order

    def reject_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.rejects:
            counts[r["reason"]] = counts.get(r["reason"], 0) + 1
        return dict(sorted(counts.items()))


def plan_samples(cfg: DistillConfig, tokenizer) -> Plan:
    """Stream the source into accepted samples and rejects (deterministic)."""
    plan, seen = Plan([], []), set()
    budget = cfg.max_seq_len - cfg.max_new_tokens
    for index, record in enumerate(iter_records(cfg.source)):
        if cfg.limit and len(plan.samples) >= cfg.limit:
            break
        try:
            if isinstance(record, Unparsable):
                raise Reject("malformed", f"{record.where}: {record.error}")
            messages = normalize_conversation(record)
            sid = sample_id(messages)
        except Reject as e:
            unparsable = isinstance(record, Unparsable)
            rid = raw_record_id(record if not unparsable else dataclasses.asdict(record))
            # a record that cannot be read has no knowable split: every split's rejects list it
            if unparsable or cfg.split == "all" or split_of(rid, cfg.heldout_fraction) == cfg.split:
                plan.rejects.append({"index": index, "sample_id": rid, "reason": e.reason, "detail": e.detail[:200]})
            continue
        if cfg.split != "all" and split_of(sid, cfg.heldout_fraction) != cfg.split:
            continue
        reason, detail = None, ""
        system, users = prompt_turns(messages)
        kept = source_messages(messages, cfg.max_turns) if cfg.responses == "source" else None
        if sid in seen:
            reason = DUPLICATE
        elif kept is not None and not any(m["role"] == "assistant" for m in kept):
            reason, detail = EMPTY, "no assistant reply to teacher-force"
        else:
            first = ([{"role": "system", "content": system}] if system is not None else []) + \
                    [{"role": "user", "content": users[0]}]
            n = len(chat_prompt_ids(tokenizer, first, cfg.thinking))
            if n > budget:
                reason, detail = TOO_LONG, f"first prompt {n} tokens > budget {budget} (max_seq_len - max_new_tokens)"
        if reason:
            plan.rejects.append({"index": index, "sample_id": sid, "reason": reason, "detail": detail})
            continue
        seen.add(sid)
        plan.samples.append({"sample_id": sid, "system": system, "users": users}
                            | ({"messages": kept} if kept is not None else {}))
    return plan


def source_hash(spec: str) -> str:
    from dflash.target import file_fingerprint

    path = resolve_source(spec)
    files = sorted(path.rglob("*.parquet")) if path.is_dir() else [path]
    return file_fingerprint(files)


def run_fingerprint(cfg: DistillConfig, meta: DatasetMetadata, src_hash: str) -> str:
    """Hash of everything that decides the output's content (not where or how fast it runs).

    `limit` is left out: the plan is a deterministic prefix of the source, so a larger
    limit adds shards after the existing ones (a dataset can grow in place)."""
    what = {k: v for k, v in cfg.as_dict().items() if k in (
        "target", "source", "split", "heldout_fraction", "seed", "batch_size", "shard_size")}
    what |= {"metadata": json.loads(meta.encode()[b"dflash"]), "source_hash": src_hash}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def _write_json_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_claim(out: Path, fingerprint: str) -> bool:
    """May this run write into out? Returns whether _run.json must be (re)written. A run
    record with no shard beside it (a run that failed before its first shard) is replaced."""
    run_file = out / RUN_NAME
    shards = shard_files(out)
    if run_file.exists():
        old = json.loads(run_file.read_text()).get("fingerprint")
        if old == fingerprint:
            return False
        if shards:
            raise DistillConfigError(f"output_dir {out} holds a run made with other settings (fingerprint {old}, "
                                     f"this config {fingerprint}): use a new output_dir or delete it")
        return True
    if shards:
        raise DistillConfigError(f"output_dir {out} already holds .parquet files not written by this run")
    return True


def _shard_done(path: Path, expected_rows: int) -> bool:
    if not path.exists():
        return False
    try:
        rows = pq.read_metadata(path).num_rows
    except Exception:  # unreadable (e.g. a disk filled up): recompute it
        rows = None
    if rows != expected_rows:  # unreadable, or the short last shard of a smaller limit
        path.unlink(missing_ok=True)
        return False
    return True


# --- the Ray part -----------------------------------------------------------------------------

def _actor_pool(cfg: DistillConfig):
    import ray

    if cfg.min_actors is not None:
        return ray.data.ActorPoolStrategy(min_size=cfg.min_actors, max_size=cfg.max_actors)
    return ray.data.ActorPoolStrategy(size=cfg.num_actors)


def _init_ray(cfg: DistillConfig):
    from pipelines.ray_session import init_ray

    return init_ray(cfg.ray_address, log_to_driver=False)


def distill_shards(cfg: DistillConfig, spec, todo: list[tuple[int, list[dict]]]) -> list[dict]:
    """Run the missing shards through the actor pool; returns one summary dict per shard."""
    from tqdm import tqdm

    from pipelines.distill_worker import ShardDistiller

    ray = _init_ray(cfg)
    # Ray Data's own bars on a terminal; in logs (jobs, CI) they become a status block every
    # 10 s, so there only the per-sample bar below reports progress
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = cfg.progress and sys.stderr.isatty()
    # a shard is one task: on a CPU a shard of long multi-turn answers takes more than Ray
    # Data's default 30 minutes of "no progress" (which failed such a run); each finished
    # shard is on disk, so a genuinely stuck run is stopped by its user, and resumes
    ctx.execution_no_progress_timeout_s = -1
    items = [{"shard": i, "samples": json.dumps(samples)} for i, samples in todo]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    ds = ds.map_batches(ShardDistiller, fn_constructor_kwargs={"spec": spec}, batch_size=1,
                        batch_format="pyarrow", compute=_actor_pool(cfg),
                        num_cpus=cfg.num_cpus_per_actor, num_gpus=cfg.num_gpus_per_actor)
    results = []
    with tqdm(total=sum(len(s) for _, s in todo), unit="sample", desc="distill", disable=not cfg.progress,
              file=sys.stderr) as bar:
        for row in ds.iter_rows():
            results.append(dict(row))
            bar.update(row["samples"])
    return results


# --- the run ----------------------------------------------------------------------------------

@dataclass
class PreparedRun:
    """What the driver decided before any generation: where, what, and the work per shard."""

    out: Path
    meta: DatasetMetadata
    fingerprint: str
    src_hash: str
    plan: Plan
    shards: list[list[dict]]  # shard i = plan.samples[i*shard_size : (i+1)*shard_size]

    def worker_spec(self, cfg: DistillConfig) -> "WorkerSpec":
        from pipelines.distill_worker import WorkerSpec

        return WorkerSpec(target=cfg.target, dtype=cfg.dtype, device=cfg.device, output_dir=str(self.out),
                          metadata=self.meta, params=cfg.generation(), seed=cfg.seed, batch_size=cfg.batch_size,
                          torch_threads=max(1, math.floor(cfg.num_cpus_per_actor)), engine=cfg.engine)


def prepare_run(cfg: DistillConfig) -> PreparedRun:
    """Start-up checks, the claim on output_dir (fingerprint), the plan and its rejects."""
    if cfg.engine == "vllm" and cfg.ray_address is None:
        from dflash.vllm_env import vllm_python

        vllm_python()  # FileNotFoundError: no vLLM venv on this machine, refused before any work
    out = prepare_output_dir(cfg.output_dir)
    info = inspect_target(cfg.target)
    layer_ids = tapped_layers(cfg, info.num_layers)
    try:
        src_hash = source_hash(cfg.source)
    except (ValueError, FileNotFoundError) as e:
        raise DistillConfigError(f"source: {e}") from e
    tmpl = hashlib.sha256(str(info.tokenizer.chat_template or "").encode()).hexdigest()[:16]
    meta = DatasetMetadata(
        target_id=info.target_id, weights_hash=info.weights_hash, num_target_layers=info.num_layers,
        hidden_size=info.hidden_size, target_layer_ids=layer_ids, features=cfg.features,
        compute_dtype=cfg.dtype, chat_template_hash=tmpl, responses=cfg.responses,
        generation=dataclasses.asdict(cfg.generation()) | {"seed": cfg.seed, "batch_size": cfg.batch_size})
    fingerprint = run_fingerprint(cfg, meta, src_hash)
    claim = _check_claim(out, fingerprint)
    try:
        plan = plan_samples(cfg, info.tokenizer)
    except (SourceError, UnicodeDecodeError) as e:
        raise DistillConfigError(f"source: {e}") from e
    shards = [plan.samples[i: i + cfg.shard_size] for i in range(0, len(plan.samples), cfg.shard_size)]
    beyond = sorted({p.name for p in shard_files(out)} - {shard_name(i) for i in range(len(shards))})
    if beyond:
        raise DistillConfigError(f"output_dir {out} holds {len(beyond)} shard(s) beyond this limit ({beyond[0]} ...): "
                                 f"a dataset only grows; raise limit or use a new output_dir")
    # every check passed: the first writes
    if claim:
        _write_json_atomic(out / RUN_NAME, json.dumps({"fingerprint": fingerprint, "config": cfg.as_dict()}, indent=1))
    _write_json_atomic(out / REJECTS_NAME, "".join(json.dumps(r) + "\n" for r in plan.rejects))
    return PreparedRun(out, meta, fingerprint, src_hash, plan, shards)


def run_distill(cfg: DistillConfig) -> dict:
    """Distill (or finish distilling) cfg.output_dir; returns the summary also in _manifest.json."""
    t0 = time.perf_counter()
    run = prepare_run(cfg)
    out = run.out
    todo = [(i, s) for i, s in enumerate(run.shards) if not _shard_done(out / shard_name(i), len(s))]
    t1 = time.perf_counter()
    results = distill_shards(cfg, run.worker_spec(cfg), todo) if todo else []
    work_s = time.perf_counter() - t1
    summary = finalize(out, run.shards, run.plan, run.meta, cfg, run.fingerprint, run.src_hash, results, work_s)
    summary["run"]["total_seconds"] = round(time.perf_counter() - t0, 2)
    _write_json_atomic(out / MANIFEST_NAME, json.dumps(summary, indent=1))
    print(format_summary(summary), file=sys.stderr)
    return summary


def finalize(out: Path, shards, plan: Plan, meta: DatasetMetadata, cfg: DistillConfig, fingerprint: str,
             src_hash: str, results: list[dict], work_s: float) -> dict:
    """Check exactly-once over the files on disk and build the manifest."""
    expected = {shard_name(i) for i in range(len(shards))}
    found = {p.name for p in shard_files(out)}
    if found != expected:
        raise RuntimeError(f"{out}: shards missing {sorted(expected - found)[:5]}, unexpected {sorted(found - expected)[:5]}")
    ids, tokens, loss_tokens = [], 0, 0
    for name in sorted(expected):
        t = pq.read_table(out / name, columns=["sample_id", "num_tokens", "loss_mask"])
        ids += t.column("sample_id").to_pylist()
        tokens += sum(t.column("num_tokens").to_pylist())
        loss_tokens += sum(sum(m) for m in t.column("loss_mask").to_pylist())
    planned = [s["sample_id"] for s in plan.samples]
    if len(ids) != len(set(ids)) or set(ids) != set(planned):
        raise RuntimeError(f"{out}: exactly-once check failed ({len(ids)} rows, {len(set(ids))} distinct, "
                           f"{len(planned)} planned)")
    size = sum((out / n).stat().st_size for n in expected)
    new_samples = sum(r["samples"] for r in results)
    new_tokens = sum(r["tokens"] for r in results)
    new_generated = sum(r["loss_tokens"] for r in results)
    width = meta.hidden_width
    return {
        "format_version": FORMAT_VERSION,
        "status": "complete",
        "output_dir": str(out),
        "samples": len(ids),
        "shards": len(shards),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "bytes": size,
        "bytes_per_token": round(size / max(tokens, 1), 1),
        "raw_feature_bytes_per_token": width * 2 if width else 0,
        "rejected": len(plan.rejects),
        "rejects": plan.reject_counts(),
        "run": {"shards_computed": len(results), "shards_skipped": len(shards) - len(results),
                "seconds": round(work_s, 2), "samples": new_samples, "tokens": new_tokens,
                "samples_per_s": round(new_samples / work_s, 3) if results else 0.0,
                "tokens_per_s": round(new_tokens / work_s, 1) if results else 0.0,
                "generated_tokens_per_s": round(new_generated / work_s, 1) if results else 0.0},
        "fingerprint": fingerprint,
        "source": {"spec": cfg.source, "hash": src_hash},
        "metadata": json.loads(meta.encode()[b"dflash"]),
        "config": cfg.as_dict(),
    }


def format_summary(s: dict) -> str:
    r = s["run"]
    rejects = ", ".join(f"{k} {v}" for k, v in s["rejects"].items()) or "none"
    return (f"distill: {s['samples']} samples in {s['shards']} shards ({r['shards_computed']} computed now, "
            f"{r['shards_skipped']} already done), {s['tokens']} tokens, {s['bytes_per_token']} bytes/token "
            f"(raw features {s['raw_feature_bytes_per_token']}); this run {r['samples_per_s']} samples/s, "
            f"{r['tokens_per_s']} tokens/s ({r['generated_tokens_per_s']} generated); rejects: {rejects} -> {s['output_dir']}")
