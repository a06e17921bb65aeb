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
cache (a fresh cache per pass, so every pass sees the same context), the median of
`repeats` passes after two warm-up ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pass_ms(model, context: int, width: int, repeats: int, vocab: int) -> float:
    import torch
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab, (1, context), generator=gen)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            cache = DynamicCache()
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            new = torch.randint(100, vocab, (1, width), generator=gen)
            t0 = time.perf_counter()
            model(input_ids=new, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[2:])


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
            ms = [pass_ms(target.model, args.context, w, args.repeats, target.vocab_size) for w in widths]
            print(f"{threads:>7} {dt:>5} " + " ".join(f"{m:>6.1f} ({m / ms[0]:.2f})" for m in ms), flush=True)
    print("each cell: ms of the pass (its cost in one-token steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
