"""Distillation throughput vs a plain transformers generate loop, and feature bytes/token.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_distill.py --limit 16 --max-new-tokens 64 [--engines native,vllm]

Both sides regenerate the same first turns of the same ShareGPT prompts with the default
target (fp32, greedy, same stop tokens):
  baseline  one process, all CPU threads, `model.generate` one prompt at a time; no features
  distill   `run_distill` on a fresh local Ray with 2 actors x 1 CPU, batched generation,
            plus the tapped-feature forward and zstd Parquet writing; timed end to end
            (Ray Dataset start-up and actor model loading included)
Generated tokens/s counts response tokens only (the loss-mask tokens). Storage compares the
written shard bytes per token with raw fp16 features (n_taps * D * 2 bytes). --engines
runs the distill side once per engine (native: our decode loop; vllm: vLLM writes the
responses, pipelines/vllm_generate.py; start-up of each actor's engine included) into
separate directories and says whether their tokens are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def baseline(prompts: list[list[int]], max_new_tokens: int) -> tuple[int, float]:
    from dflash.target import load_target

    target = load_target("default", dtype="fp32")
    stops = target.stop_token_ids
    generated, t0 = 0, time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_new_tokens, eos_token_id=stops, pad_token_id=stops[0])
        generated += out.shape[1] - len(p)
    return generated, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--engines", default="native")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import ray

    from dflash.regenerate import chat_prompt_ids
    from pipelines.distill import DistillConfig, inspect_target, plan_samples, run_distill
    from pipelines.ray_session import init_ray

    out = tempfile.mkdtemp(prefix="bench-distill-")
    cfg = DistillConfig(limit=args.limit, max_new_tokens=args.max_new_tokens, max_turns=1, max_seq_len=1024,
                        batch_size=args.batch_size, shard_size=args.batch_size, num_actors=args.actors,
                        num_cpus_per_actor=1, output_dir=os.path.join(out, "native"), progress=False)
    plan = plan_samples(cfg, inspect_target("default").tokenizer)
    tok = inspect_target("default").tokenizer
    prompts = [chat_prompt_ids(tok, ([{"role": "system", "content": s["system"]}] if s["system"] else [])
                               + [{"role": "user", "content": s["users"][0]}]) for s in plan.samples]

    torch.set_num_threads(os.cpu_count() or 1)
    base_tokens, base_s = (0, float("nan")) if args.no_baseline else baseline(prompts, args.max_new_tokens)

    import dataclasses

    import pyarrow.parquet as pq

    engines, rows = {}, {}
    init_ray("local", num_cpus=args.actors, log_to_driver=False)
    try:
        for engine in args.engines.split(","):
            run_cfg = dataclasses.replace(cfg, engine=engine, output_dir=os.path.join(out, engine))
            t0 = time.perf_counter()
            summary = run_distill(run_cfg)
            dist_s = time.perf_counter() - t0
            engines[engine] = {"generated_tokens_per_s": round(summary["loss_tokens"] / dist_s, 1),
                               "seconds_end_to_end": round(dist_s, 1)}
            table = pq.read_table(run_cfg.output_dir, columns=["sample_id", "input_ids"])
            rows[engine] = dict(zip(table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist()))
    finally:
        ray.shutdown()
    first = next(iter(rows.values()))
    dist_tokens = summary["loss_tokens"]
    result = {
        "samples": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "engines": engines,
        "engines_identical_tokens": all(r == first for r in rows.values()),
        "baseline_generated_tokens": base_tokens,
        "baseline_seconds": round(base_s, 1),
        "baseline_generated_tokens_per_s": round(base_tokens / base_s, 1) if base_tokens else None,
        "distill_generated_tokens": dist_tokens,
        "distill_seconds_end_to_end": round(dist_s, 1),
        "distill_generated_tokens_per_s": round(dist_tokens / dist_s, 1),
        "distill_all_tokens_per_s": round(summary["tokens"] / dist_s, 1),
        "stored_bytes_per_token": summary["bytes_per_token"],
        "raw_feature_bytes_per_token": summary["raw_feature_bytes_per_token"],
        "storage_ratio": round(summary["bytes_per_token"] / summary["raw_feature_bytes_per_token"], 3),
        "output_dir": out,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
