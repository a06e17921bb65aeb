"""Core costs on the default target and the learning-test drafter's speed-up.

    .venv/bin/python benchmarks/bench_core.py [--threads 2] [--steps 120]

Prints, for bf16 on CPU: the time of one drafter pass (B=16 and B=8), one verify pass of
16 and 8 tokens and one autoregressive step over a ~200-token cache; then trains the
memorising drafter of tests/test_objective.py (fp32) and reports its tau and speed-up
against autoregressive decoding on its own prompts, in bf16, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dflash.bench import run_bench  # noqa: E402
from dflash.config import DrafterConfig  # noqa: E402
from dflash.decoding import SamplingParams, SpeculativeDecoder  # noqa: E402
from dflash.drafter import DFlashDrafter  # noqa: E402
from dflash.target import load_target  # noqa: E402
from support import CHAT_PROMPTS, chat_prompt_ids, train_memorising_drafter  # noqa: E402


def timed(fn, repeats=20):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def pass_costs(target, drafter_for):
    """Median ms of a draft pass, a verify pass and an AR step after a ~200-token prefill."""
    prompt = target.chat_ids([{"role": "user", "content": " ".join(CHAT_PROMPTS * 3)}])[:200]
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
        from dflash.masks import extend_attention_mask
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
    ap.add_argument("--steps", type=int, default=120)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = load_target("default", dtype="bf16")

    def random_drafter(B):
        cfg = DrafterConfig.for_target(bf16, num_taps=3, block_size=B)
        return DFlashDrafter(cfg).to(torch.bfloat16).eval()

    print(f"default target, bf16, CPU, {args.threads} threads, 1-layer drafter, ~200-token context")
    for name, ms in pass_costs(bf16, random_drafter).items():
        print(f"  {name:24s} {ms:7.2f} ms")

    fp32 = load_target("default", dtype="fp32")
    prompts = chat_prompt_ids(fp32, CHAT_PROMPTS[:4])
    t0 = time.time()
    drafter, history, _ = train_memorising_drafter(fp32, prompts, steps=args.steps)
    print(f"learning-test drafter: {args.steps} steps in {time.time() - t0:.0f} s, final loss "
          f"{history[-1]['loss']:.4f}, per-position acc {[round(a, 2) for a in history[-1]['acc']]}")
    d16 = DFlashDrafter(drafter.config)
    d16.load_state_dict(drafter.state_dict())
    for dtype, target, d in (("bf16", bf16, d16.to(torch.bfloat16).eval()), ("fp32", fp32, drafter)):
        r = run_bench(target, d, prompts, max_new_tokens=40)
        print(f"  {dtype}: tau {r['tau']:.2f}  AR {r['ar_tokens_per_s']:.1f} tok/s  DFlash "
              f"{r['dflash_tokens_per_s']:.1f} tok/s  speedup {r['speedup']:.2f}x  lossless {r['lossless']}")


if __name__ == "__main__":
    main()
