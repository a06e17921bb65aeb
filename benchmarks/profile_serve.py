"""Does serving keep the decode loop's gain? The serving engine against the bench loop,
the same decoder, prompts and thread count, in one process (no Ray, no HTTP).

    .venv/bin/python benchmarks/profile_serve.py --limit 8 --max-new-tokens 64 --concurrency 1,8 [--profile]

For AR (no drafter) and for the default pair (the shipped drafter, lookup, corpus, adaptive
width), at each concurrency c:
  loop    SpeculativeDecoder.generate over the prompts, c at a time: what `dflash bench`
          times (c = 1: one request at a time);
  engine  serve.engine.BatchingEngine (what a replica runs) with c asyncio clients in a
          closed loop over the same prompts: admission, chunked prefill, worker-thread
          steps, token delivery, row drops and compaction included.
Per cell: output tokens/s, model time per step (the decoder's own draft+verify clock) and
wall time per step (everything else an iteration does is the difference), and the engine's
tokens/s as a fraction of the loop's. --profile adds a cProfile of each engine cell: the
functions with the most own time, outside the target's forward.

HTTP, JSON and streaming on top of the engine are measured by bench_serve.py.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_loop(decoder, prompts, params, concurrency: int) -> dict:
    t0 = time.perf_counter()
    done = decoder.generate(prompts, params, batch_size=concurrency)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in done)
    chunks = [done[i:i + concurrency] for i in range(0, len(done), concurrency)]  # one batch each
    steps = sum(max(len(r.stats.acceptance_lengths) for r in chunk) for chunk in chunks)
    return {"tokens": tokens, "wall_s": wall, "steps": steps}


async def _engine_cell(engine, prompts, params, concurrency: int) -> dict:
    queue = list(range(len(prompts)))
    tokens = 0

    async def client():
        nonlocal tokens
        while queue:
            i = queue.pop(0)
            gen = engine.submit(prompts[i], params)
            async for toks in gen.tokens():
                tokens += len(toks)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await engine.close()
    return {"tokens": tokens, "wall_s": wall}


def run_engine(decoder, prompts, params, concurrency: int, profile: bool) -> dict:
    from serve.engine import BatchingEngine

    reports = []
    engine = BatchingEngine(decoder, max_batch_size=concurrency, on_step=reports.append)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    out = asyncio.run(_engine_cell(engine, prompts, params, concurrency))
    if prof:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
        out["profile"] = text.getvalue()
    steps = [r for r in reports if r.batch_size > 0]
    out["steps"] = len(steps)
    out["model_s"] = sum(r.draft_time_s + r.verify_time_s for r in steps)
    out["mean_rows"] = sum(r.batch_size for r in steps) / max(1, len(steps))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a replica's torch_threads: 1)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from dflash.bench import cpu_description
    from dflash.pair import DecodeConfig, load_pair
    from dflash.prompts import load_prompt_set
    from dflash.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    pair = load_pair(DecodeConfig(target=args.target, drafter="auto", dtype=args.dtype))
    ar = load_pair(DecodeConfig(target=args.target, drafter="none", dtype=args.dtype), target=pair.target)
    tok = pair.target
    prompts = [tok.chat_ids(c) for c in load_prompt_set(args.dataset)[: args.limit]]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    cpu = cpu_description()
    native = cpu["avx512_bf16"] or cpu["amx_bf16"]
    print(f"cpu: {cpu['model']} native_bf16={native} threads={args.threads} "
          f"dtype={pair.dtype_reason}", flush=True)
    run_loop(ar.decoder, prompts[:1], params, 1)  # warm up both paths
    run_loop(pair.decoder, prompts[:1], params, 1)

    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        for name, dec in (("AR", ar.decoder), ("DFlash", pair.decoder)):
            loop = run_loop(dec, prompts, params, c)
            eng = run_engine(dec, prompts, params, c, args.profile)
            rows.append((name, c, loop, eng))
            print(f"  done: {name} c={c}", file=sys.stderr, flush=True)
            if args.profile:
                print(f"\n--- engine profile: {name} c={c} ---\n{eng['profile']}")

    print(f"\n{args.dataset}, {len(prompts)} prompts, {args.max_new_tokens} new tokens, T=0")
    print(f"{'mode':<7} {'conc':>4} {'loop tok/s':>10} {'engine tok/s':>12} {'engine/loop':>11} "
          f"{'loop ms/step':>12} {'engine ms/step':>14} {'model ms/step':>13} {'rows/step':>9}")
    for name, c, loop, eng in rows:
        lt, et = loop["tokens"] / loop["wall_s"], eng["tokens"] / eng["wall_s"]
        print(f"{name:<7} {c:>4} {lt:>10.1f} {et:>12.1f} {et / lt:>10.2f}x "
              f"{1000 * loop['wall_s'] / max(1, loop['steps']):>12.1f} "
              f"{1000 * eng['wall_s'] / max(1, eng['steps']):>14.1f} "
              f"{1000 * eng['model_s'] / max(1, eng['steps']):>13.1f} {eng['mean_rows']:>9.2f}")
    by = {(n, c): (lo, e) for n, c, lo, e in rows}
    for c in sorted({c for _, c, _, _ in rows}):
        (al, ae), (dl, de) = by[("AR", c)], by[("DFlash", c)]
        print(f"speedup over AR at c={c}: loop {(dl['tokens'] / dl['wall_s']) / (al['tokens'] / al['wall_s']):.2f}x, "
              f"engine {(de['tokens'] / de['wall_s']) / (ae['tokens'] / ae['wall_s']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
