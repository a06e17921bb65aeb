"""Will speculation pay on this machine? The target's verify cost curve, in one-token steps.

    .venv/bin/python benchmarks/bench_verify_curve.py [--dtypes bf16,fp32] [--threads 1,2] \
        [--widths 1,2,4,8,16] [--context 200] [--repeats 12]

A speculative cycle verifies W tokens in one target pass. Its speed-up over AR is tau
divided by what that pass (plus the draft) costs in AR steps, so the curve of
pass(W) / pass(1) decides how wide a guess pays: near 1 (a pass bound by reading the
weights: bf16 on a CPU with native bf16, a GPU) wide guesses are almost free; near W (a
pass bound by arithmetic: bf16 emulated, often fp32 on CPU) only well-accepted guesses
pay. The decoder measures the same thing at start-up and online (dflash.width.CostModel);
this script prints it for every dtype and thread count in one run, with the CPU it ran on,
so figures from different machines can be set side by side.

For each (threads, dtype): the target's forward over W new tokens after a `context`-token
prefill, as a verify runs it (the cache cropped back after each pass, so every pass sees
the same context), the median of `repeats` passes after two warm-up ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def curve_ms(target, context: int, widths: list[int], repeats: int) -> list[float]:
    """Median ms of the target's pass over W tokens (each W in widths) after a `context`-token
    prefill, the way a cycle's verify runs it (Target.forward with the decoder's mask and
    cache), the cache cropped back after every pass: the prefill runs once."""
    import torch

    from dflash.decoding import SpeculativeDecoder
    from dflash.masks import extend_attention_mask
    from dflash.sampling import SamplingParams

    ar = SpeculativeDecoder(target)
    prompt = [(7 * k) % (target.vocab_size - 1) + 1 for k in range(context)]
    batch = ar.prefill([prompt], SamplingParams(max_new_tokens=1))
    out = []
    with torch.no_grad():
        for w in widths:
            ids = batch.anchor[:, None].repeat(1, w)
            pos = batch.next_pos[:, None] + torch.arange(w, device=batch.next_pos.device)
            mask = extend_attention_mask(batch.slot_valid, w, causal=True)
            times = []
            for _ in range(repeats + 2):
                t0 = time.perf_counter()
                target.forward(ids, pos, mask, batch.cache)
                times.append(time.perf_counter() - t0)
                batch.cache.crop(-w)
            out.append(1000 * statistics.median(times[2:]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    if widths[0] != 1:
        ap.error("--widths must start with 1 (the AR step the curve is counted in)")

    import torch

    from dflash.bench import cpu_description
    from dflash.target import load_target

    cpu = cpu_description()
    print(f"cpu: {cpu['model']}, avx512_bf16 {cpu['avx512_bf16']}, amx_bf16 {cpu['amx_bf16']}; "
          f"{args.context} cached tokens, median of {args.repeats}", flush=True)
    print(f"{'threads':>7} {'dtype':>5} " + " ".join(f"{'W=' + str(w):>14}" for w in widths))
    targets = {dt: load_target(args.target, dtype=dt) for dt in args.dtypes.split(",")}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for dt, target in targets.items():
            ms = curve_ms(target, args.context, widths, args.repeats)
            print(f"{threads:>7} {dt:>5} " + " ".join(f"{m:>6.1f} ({m / ms[0]:.2f})" for m in ms), flush=True)
    print("each cell: ms of the pass (its cost in one-token steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
