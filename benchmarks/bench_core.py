"""Core costs on the default target and the shipped reference drafter's speed-up.

    .venv/bin/python benchmarks/bench_core.py [--threads 2] [--limit 4] [--max-new-tokens 40]

Prints, for bf16 on CPU: the time of one drafter pass (B=16 and B=8, a random 1-layer
drafter), one verify pass of 16 and 8 tokens and one autoregressive step over a ~200-token
cache; then the reference drafter shipped for the default target (dflash/drafters/) against
autoregressive decoding on the first MT-Bench questions, in bf16 and fp32, in the same run
(dflash.bench.run_bench: tau, speed-up, lossless).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash.bench import run_bench
from dflash.config import DrafterConfig
from dflash.decoding import SpeculativeDecoder
from dflash.drafter import DFlashDrafter
from dflash.masks import extend_attention_mask
from dflash.pair import DecodeConfig, load_pair
from dflash.prompts import load_prompt_set
from dflash.sampling import SamplingParams
from dflash.target import load_target


def timed(fn, repeats=20):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def pass_costs(target, drafter_for, questions: list[str]):
    """Median ms of a draft pass, a verify pass and an AR step after a ~200-token prefill."""
    prompt = target.chat_ids([{"role": "user", "content": " ".join(questions)}])[:200]
    rows = {}
    ar = SpeculativeDecoder(target)
    batch = ar.prefill([prompt], SamplingParams(4))
    S = batch.num_slots

    def ar_step():
        ar.step(batch)
        batch.cache.crop(-1)
        batch.slot_valid = batch.slot_valid[:, :S]
        batch.next_pos -= 1
    rows["AR step (1 token)"] = timed(ar_step)
    for B in (16, 8):
        dec = SpeculativeDecoder(target, drafter_for(B))
        b = dec.prefill([prompt], SamplingParams(4))
        rows[f"draft pass B={B}"] = timed(lambda: dec.draft_logits(b))
        ids = torch.full((1, B), 100)
        pos = b.next_pos[:, None] + torch.arange(B)
        mask = extend_attention_mask(b.slot_valid, B, causal=True)

        def verify():
            with torch.no_grad():
                target.forward(ids, pos, mask, b.cache, tap_layer_ids=dec.tap_ids)
            b.cache.crop(-B)
        rows[f"verify pass {B} tokens"] = timed(verify)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=4, help="MT-Bench questions decoded")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    questions = [conv[0]["content"] for conv in load_prompt_set("mt-bench")[: max(args.limit, 8)]]
    bf16 = load_target("default", dtype="bf16")

    def random_drafter(B):
        cfg = DrafterConfig.for_target(bf16, num_taps=3, block_size=B)
        return DFlashDrafter(cfg).to(torch.bfloat16).eval()

    print(f"default target, bf16, CPU, {args.threads} threads, 1-layer drafter, ~200-token context")
    for name, ms in pass_costs(bf16, random_drafter, questions).items():
        print(f"  {name:24s} {ms:7.2f} ms")

    fp32 = load_target("default", dtype="fp32")
    print(f"reference drafter alone, {args.limit} MT-Bench questions x {args.max_new_tokens} new tokens")
    for dtype, target in (("bf16", bf16), ("fp32", fp32)):
        pair = load_pair(DecodeConfig(drafter="default", dtype=dtype, lookup=False, corpus=None), target=target)
        prompts = [target.chat_ids([{"role": "user", "content": q}]) for q in questions[: args.limit]]
        r = run_bench(pair.decoder, prompts, max_new_tokens=args.max_new_tokens)
        print(f"  {dtype}: tau {r['tau']:.2f}  AR {r['ar_tokens_per_s']:.1f} tok/s  DFlash "
              f"{r['dflash_tokens_per_s']:.1f} tok/s  speedup {r['speedup']:.2f}x  lossless {r['lossless']}")


if __name__ == "__main__":
    main()
