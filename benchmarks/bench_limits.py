"""What limits a drafter's speed-up: the cost of a cycle, and acceptance by draft position.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_limits.py --datasets mt-bench,humaneval \
        --limit 5 --max-new-tokens 64 --threads 2 [--drafter default] [--json limits.json]

Speed-up over autoregressive decoding is tau / cycle cost, where the cycle cost is one
DFlash cycle's time counted in AR steps. So a target speed-up needs tau = speed-up x cycle
cost, and tau is set by how often each draft position is accepted. For each dataset and
temperature this decodes the prompts with the drafter alone (no context or corpus lookup:
the drafter is what is measured), with `dflash.bench.run_bench` (AR beside it in the same
run, one prompt at a time, bf16 by default), and prints two tables:

  cost        the AR step (AR's time per token), and a cycle's draft, verify and other
              time, all in ms; the cycle cost in AR steps, which is also the tau that
              break-even (1x) needs; so the tau that 2x needs. Both sides' times include their prefill, as the speed-up does:
              "other" is a cycle's share of the prefill plus Python and cache bookkeeping
  acceptance  P(draft k accepted | drafts 1..k-1 accepted) for k = 1..B-1 (pooled over
              all cycles of all prompts; `acceptance_by_position` of `dflash bench`), tau, and the acceptance each position would need,
              the same at every position, for the tau 2x needs and for tau 3

A cycle that ends a request early (a stop token, the token budget) counts as rejecting at
the position where it stopped, which lowers the later positions' rates slightly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dflash.bench import run_bench
from dflash.pair import DecodeConfig, load_pair
from dflash.prompts import load_prompt_set


def uniform_rate_for(tau: float, block_size: int) -> float | None:
    """The acceptance a, the same at every draft position, with 1 + a + ... + a^(B-1) = tau
    (None when tau > B: out of reach at this block size whatever the drafter)."""
    if tau >= block_size:
        return None if tau > block_size else 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(block_size)) < tau:
            lo = mid
        else:
            hi = mid
    return lo


def limits(result: dict) -> dict:
    """Cost and acceptance figures from one `run_bench` result (no lookup, no corpus)."""
    B = result["block_size"]
    ar_ms = 1000 / result["ar_tokens_per_s"]
    cost = result["cycle_cost_ar_steps"]
    cycle_ms = cost * ar_ms
    return {
        "block_size": B,
        "ar_step_ms": ar_ms,
        "draft_ms": result["draft_time_per_cycle_ms"],
        "verify_ms": result["verify_time_per_cycle_ms"],
        "other_ms": cycle_ms - result["draft_time_per_cycle_ms"] - result["verify_time_per_cycle_ms"],
        "cycle_ms": cycle_ms,
        "cycle_cost_ar_steps": cost,
        "tau": result["tau"],
        "speedup": result["speedup"],
        "tau_for_2x": 2 * cost,
        "acceptance_by_position": result["acceptance_by_position"],
        "uniform_acceptance_for_2x": uniform_rate_for(2 * cost, B),
        "uniform_acceptance_for_tau3": uniform_rate_for(3.0, B),
    }


def _rate(x: float | None, none: str = "-") -> str:
    """A rate to 2 decimals; `none` where there is none (a position no cycle reached, or a
    tau beyond the block)."""
    return none if x is None else f"{x:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--drafter", default="default", help="'default' (the shipped reference drafter) or a directory")
    ap.add_argument("--block-size", type=int, default=None, help="override the drafter's decode block size")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    pair = load_pair(DecodeConfig(drafter=args.drafter, dtype=args.dtype, device=args.device,
                                  block_size=args.block_size or 0, lookup=False, corpus=None))
    target, path = pair.target, pair.drafter_source
    if path is None:
        sys.exit(f"no drafter {args.drafter!r} for {target.target_id}")

    rows = []
    for name in args.datasets.split(","):
        prompts = [target.chat_ids(c) for c in load_prompt_set(name.strip())[: args.limit]]
        for temp in (float(t) for t in args.temperatures.split(",")):
            r = run_bench(pair.decoder, prompts, max_new_tokens=args.max_new_tokens, temperature=temp)
            rows.append({"dataset": name, "temperature": temp, "prompts": len(prompts), "lossless": r["lossless"],
                         **limits(r)})
            print(f"[limits] {name} T={temp:g}: tau {r['tau']:.2f}, {r['speedup']:.2f}x", file=sys.stderr, flush=True)

    print(f"\n{target.target_id}, drafter {args.drafter} ({Path(path).name}), {args.dtype}, {args.device}, {args.threads} threads, "
          f"block {rows[0]['block_size']}, drafter alone, {args.limit} prompts x {args.max_new_tokens} new tokens\n")
    print("| dataset | T | AR step ms | draft ms | verify ms | other ms | cycle cost (AR steps) | tau | speedup "
          "| tau for 2x |")
    print("|" + "---|" * 10)
    for r in rows:
        print(f"| {r['dataset']} | {r['temperature']:g} | {r['ar_step_ms']:.1f} | {r['draft_ms']:.1f} | "
              f"{r['verify_ms']:.1f} | {r['other_ms']:.1f} | {r['cycle_cost_ar_steps']:.2f} | {r['tau']:.2f} | "
              f"{r['speedup']:.2f}x | {r['tau_for_2x']:.2f} |")
    B = rows[0]["block_size"]
    print()
    print("| dataset | T | " + " | ".join(f"P(accept {k})" for k in range(1, B)) +
          " | tau | every position needs, for 2x | for tau 3 | lossless |")
    print("|" + "---|" * (B + 5))
    for r in rows:
        acc = " | ".join(_rate(a) for a in r["acceptance_by_position"])
        lossless = {True: "yes", False: "NO", None: "n/a (T>0)"}[r["lossless"]]
        print(f"| {r['dataset']} | {r['temperature']:g} | {acc} | {r['tau']:.2f} | "
              f"{_rate(r['uniform_acceptance_for_2x'], 'out of reach')} | "
              f"{_rate(r['uniform_acceptance_for_tau3'], 'out of reach')} | {lossless} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
