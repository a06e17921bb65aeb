"""Distillation without Ray: plan where the source is, generate on one machine that has the
accelerator (and perhaps no Ray), finish with `dflash distill`.

    python -m jobs.distill_local plan --config jobs/configs/reference/distill.yaml PLAN.json.gz [key=value ...]
    python -m jobs.distill_local run PLAN.json.gz OUT_DIR [--device cuda] [--seconds S] [--shards A:B] [--engine vllm]
    cp OUT_DIR/part-*.parquet <output_dir>/
    dflash distill --config jobs/configs/reference/distill.yaml limit=N   # N = the summary's "limit"

`plan` is the distill driver's own start-up: checks, the claim on output_dir (fingerprint,
_run.json), the plan and its rejects; it saves each shard's samples and the worker spec in
one gzipped JSON file (a few MB for thousands of prompts). `run` needs only torch,
transformers, pyarrow and the target: it feeds the shards, in order, through the same
`ShardDistiller` the Ray Data pool runs, until all are done or `--seconds` is spent, so
the files it writes are those `dflash distill` writes (same names, metadata and rows).
`--shards A:B` runs only shards A..B-1 (split one plan across machines, or grow a dataset
whose first shards live elsewhere); `--engine vllm` writes the responses with vLLM, as
`engine: vllm` does in `dflash distill`.
Placed in the output directory, they count as done: `dflash distill` computes only what is
missing, checks exactly-once and writes the manifest. The plan is a prefix of the source, so
the first k shards with limit = k x shard_size are a complete dataset of their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import sys
import time
from pathlib import Path

PLAN_FORMAT = 1


def write_plan(cfg, path: Path) -> dict:
    """cfg: a validated pipelines.distill.DistillConfig."""
    from dflash.data import METADATA_KEY
    from pipelines.distill import prepare_run

    run = prepare_run(cfg)
    spec = run.worker_spec(cfg)
    doc = {
        "format": PLAN_FORMAT,
        "fingerprint": run.fingerprint,
        "shard_size": cfg.shard_size,
        "spec": {"target": spec.target, "dtype": spec.dtype, "seed": spec.seed, "batch_size": spec.batch_size,
                 "params": dataclasses.asdict(spec.params),
                 "metadata": json.loads(spec.metadata.encode()[METADATA_KEY])},
        "shards": run.shards,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(doc, f)
    return {"plan": str(path), "shards": len(run.shards), "samples": len(run.plan.samples),
            "rejected": len(run.plan.rejects), "fingerprint": run.fingerprint, "bytes": path.stat().st_size}


def run_plan(path: Path, out_dir: Path, device: str, seconds: float, threads: int,
             shards: tuple[int, int | None] = (0, None), engine: str = "native") -> dict:
    """Shards shards[0]..shards[1]-1 (None: to the end) in plan order until done or out of
    time; a shard already in out_dir is kept."""
    from dflash.data import DatasetMetadata, METADATA_KEY
    from dflash.regenerate import GenerationParams
    from pipelines.distill_worker import ShardDistiller, WorkerSpec

    t0 = time.perf_counter()
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    if doc.get("format") != PLAN_FORMAT:
        raise ValueError(f"{path}: plan format {doc.get('format')}, this code reads {PLAN_FORMAT}")
    s = doc["spec"]
    meta = DatasetMetadata.decode({METADATA_KEY: json.dumps(s["metadata"]).encode()}, str(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = WorkerSpec(target=s["target"], dtype=s["dtype"], device=device, output_dir=str(out_dir), metadata=meta,
                      params=GenerationParams(**s["params"]), seed=s["seed"], batch_size=s["batch_size"],
                      torch_threads=threads, engine=engine)
    first, end = shards
    end = len(doc["shards"]) if end is None else end
    if not 0 <= first < end <= len(doc["shards"]):
        raise ValueError(f"--shards {first}:{end} is not a range within the plan's {len(doc['shards'])} shards")
    worker = ShardDistiller(spec)
    print(f"distill_local: target loaded in {time.perf_counter() - t0:.1f}s; {len(doc['shards'])} shards planned, "
          f"running {first}..{end - 1}", file=sys.stderr, flush=True)
    done, samples, tokens, generated = 0, 0, 0, 0
    for index in range(first, end):
        shard = doc["shards"][index]
        if time.perf_counter() - t0 > seconds:
            break
        r = worker.distill_shard(index, shard)
        done, samples, tokens, generated = done + 1, samples + r["samples"], tokens + r["tokens"], \
            generated + r["loss_tokens"]
        elapsed = time.perf_counter() - t0
        print(f"shard {index}: {r['samples']} samples, {r['loss_tokens']} generated tokens in {r['seconds']:.1f}s "
              f"({r['loss_tokens'] / max(r['seconds'], 1e-9):.0f} tok/s); total {samples} samples, {generated} "
              f"generated, {elapsed:.0f}s", file=sys.stderr, flush=True)
    summary = {"shards_done": done, "first_shard": first, "limit": first * doc["shard_size"] + samples,
               "samples": samples, "tokens": tokens, "generated_tokens": generated,
               "seconds": round(time.perf_counter() - t0, 1), "device": device, "fingerprint": doc["fingerprint"]}
    (out_dir / "_local_run.json").write_text(json.dumps(summary, indent=1))
    return summary


def parse_shard_range(text: str) -> tuple[int, int | None]:
    """"A:B" -> (A, B); "A:" -> (A, None); "A" -> (A, A + 1)."""
    try:
        if ":" not in text:
            return int(text), int(text) + 1
        a, b = text.split(":", 1)
        return int(a or 0), (int(b) if b else None)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shards: expected A:B, A: or A, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.distill_local", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    pp = sub.add_parser("plan", help="check, claim output_dir, plan; save the shards' samples")
    pp.add_argument("--config", required=True)
    pp.add_argument("plan_file", type=Path)
    pp.add_argument("overrides", nargs="*", help="key=value")
    pr = sub.add_parser("run", help="distill a plan's shards here, in order")
    pr.add_argument("plan_file", type=Path)
    pr.add_argument("out_dir", type=Path)
    pr.add_argument("--device", default="cpu")
    pr.add_argument("--seconds", type=float, default=float("inf"), help="start no shard after this many seconds")
    pr.add_argument("--threads", type=int, default=1)
    pr.add_argument("--shards", type=parse_shard_range, default=(0, None), metavar="A:B",
                    help="run only shards A..B-1 of the plan (B left out: to the end; default all)")
    pr.add_argument("--engine", choices=("native", "vllm"), default="native",
                    help="who writes the responses: our decode loop, or vLLM (needs `make vllm-venv`)")
    args = p.parse_args(argv)
    if args.verb == "plan":
        from dflash.config_file import load_config
        from pipelines.distill import DistillConfig

        result = write_plan(load_config(DistillConfig, args.config, args.overrides), args.plan_file)
    else:
        result = run_plan(args.plan_file, args.out_dir, args.device, args.seconds, args.threads,
                          args.shards, args.engine)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
