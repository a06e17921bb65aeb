"""Ours against vLLM, from `dflash bench --vllm` runs: one markdown row per (dtype, block,
dataset), with each engine's start-up measured here in fresh processes.

    for dt in bf16 fp32; do for b in 4 8; do
      dflash bench --dataset mt-bench,humaneval --limit 10 --max-new-tokens 128 --temperatures 0 \\
          --drafter-only --vllm --no-prompt-lookup --dtype $dt --block-size $b --threads 1 --out runs/peer/$dt-b$b
    done; done
    python benchmarks/vllm_peer_table.py runs/peer/*/bench.json

Columns: our AR tokens/s; the drafter alone (no lookup, no corpus) and the defaults (lookup
and corpus) as tokens/s, speedup over our AR and tau; vLLM AR and vLLM DFlash (same
drafter, block and prompts, one request at a time) as tokens/s, speedup over vLLM's AR, tau
and acceptance by draft position (vLLM's own counters); then our drafter's acceptance by
position (from the defaults run's drafter cycles). Start-up: ours is `load_pair` (target,
drafter, corpus, the width calibration) in a fresh process; vLLM's is its engine build
(LLM(...)) as the bench's runner timed it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STARTUP = ("import time; t=time.perf_counter(); from dflash.pair import DecodeConfig, load_pair; "
           "load_pair(DecodeConfig(dtype='{dtype}', block_size={block})); print(time.perf_counter()-t)")


def our_startup(dtype: str, block: int) -> float:
    out = subprocess.run([sys.executable, "-c", STARTUP.format(dtype=dtype, block=block)], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def fmt(rates) -> str:
    return " / ".join("-" if r is None else f"{r:.2f}" for r in rates)


def main(paths: list[str]) -> int:
    rows, startups = [], {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            v = r.get("vllm")
            if not v:
                continue
            dtype = "bf16" if "bfloat16" in r["dtype"] else "fp32"
            key = (dtype, r["block_size"])
            if key not in startups:
                startups[key] = our_startup(dtype, r["block_size"])
            drafter_rates = (r.get("acceptance_by_source") or {}).get("drafter") or []
            rows.append((dtype, r["block_size"], r["dataset"], r, v, startups[key], drafter_rates))
    rows.sort(key=lambda x: (x[0], x[1], x[2]))
    cpu = rows[0][3]["cpu"] if rows else {}
    print(f"CPU: {cpu.get('model')}, avx512_bf16 {cpu.get('avx512_bf16')}, amx_bf16 {cpu.get('amx_bf16')}\n")
    print("| dtype | block | dataset | our AR tok/s | ours, drafter alone: tok/s, speedup, tau | ours, defaults: "
          "tok/s, speedup, tau | vLLM AR tok/s | vLLM DFlash: tok/s, speedup, tau | vLLM acceptance by position | "
          "our drafter's acceptance by position | start-up s, ours / vLLM |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype, block, ds, r, v, ours_s, rates in rows:
        alone = r["drafter_only_tokens_per_s"]
        print(f"| {dtype} | {block} | {ds} | {r['ar_tokens_per_s']:.1f} | {alone:.1f}, "
              f"{r['drafter_only_speedup']:.2f}x, {r['drafter_only_tau']:.2f} | {r['dflash_tokens_per_s']:.1f}, "
              f"{r['speedup']:.2f}x, {r['tau']:.2f} | {v['ar_tokens_per_s']:.1f} | {v['dflash_tokens_per_s']:.1f}, "
              f"{v['speedup']:.2f}x, {v['tau']:.2f} | {fmt(v['acceptance_by_position'])} | "
              f"{fmt(rates[: block - 1])} | {ours_s:.1f} / {v['startup_s']['dflash']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
