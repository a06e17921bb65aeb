"""Adaptive width vs a pinned block, each against AR in the same run (issue 31).

    nice .venv/bin/python benchmarks/bench_width.py [--datasets mt-bench,humaneval] [--limit 10]
        [--max-new-tokens 128] [--dtypes bf16,fp32] [--pinned 4] [--threads 1] [--json OUT.json]

For each dtype: one target load, the default pair (shipped drafter, context lookup, corpus)
twice - adaptive width (the default, DecodeConfig.block_size 0) and the block pinned at
--pinned (what `--block-size 4` does) - each through dflash.bench.run_bench (AR baseline
beside it, T = 0, lossless checked). The same thing as `dflash bench` run four times, with
the target loaded once per dtype. Prints tau, speedup, the chosen widths and the cost curve.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dflash.bench import cpu_description, run_bench
from dflash.pair import DecodeConfig, load_pair
from dflash.prompts import load_prompt_set
from dflash.target import load_target


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--pinned", type=int, default=4, help="the pinned block; 0: adaptive only")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (2 on a busy 2-core machine oversubscribes)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_description()
    print(f"CPU {cpu['model']}: avx512_bf16 {cpu['avx512_bf16']}, amx_bf16 {cpu['amx_bf16']}, "
          f"{args.threads} threads", flush=True)
    rows = []
    for dtype in args.dtypes.split(","):
        target = load_target("default", dtype=dtype)
        for width in ("adaptive", f"pinned {args.pinned}")[: 2 if args.pinned else 1]:
            block = 0 if width == "adaptive" else args.pinned
            pair = load_pair(DecodeConfig(dtype=dtype, block_size=block), target=target)
            for name in args.datasets.split(","):
                convs = load_prompt_set(name)[: args.limit]
                prompts = [target.chat_ids(c) for c in convs]
                def progress(i, n, row, tag=f"{dtype} {width} {name}"):
                    print(f"  [{tag}] {i}/{n} tau {row['tau']:.2f}", file=sys.stderr, flush=True)

                r = run_bench(pair.decoder, prompts, max_new_tokens=args.max_new_tokens, progress=progress)
                row = {"dtype": dtype, "width": width, "dataset": name, **{k: r[k] for k in (
                    "tau", "speedup", "ar_tokens_per_s", "dflash_tokens_per_s", "mean_verify_width",
                    "verify_width_histogram", "verify_cost_curve", "acceptance_by_source", "lossless",
                    "lookup_cycle_fraction", "corpus_cycle_fraction")}}
                rows.append(row)
                curve = " ".join(f"{c:.2f}" for c in row["verify_cost_curve"] or [])
                print(f"{dtype} {width:9s} {name:10s} tau {r['tau']:.2f} speedup {r['speedup']:.2f}x "
                      f"(AR {r['ar_tokens_per_s']:.1f}, DFlash {r['dflash_tokens_per_s']:.1f} tok/s) "
                      f"mean W {r['mean_verify_width']:.2f} widths {r['verify_width_histogram']} "
                      f"lossless {r['lossless']}\n    cost curve (AR steps, W=1..) {curve}\n"
                      f"    acceptance by source {r['acceptance_by_source']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "runs": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
