"""Teacher-forced source responses vs regenerated ones: cost per response token, and how
often the target's own greedy choice agrees with the source text.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_teacher_forcing.py --limit 32

Both sides take the same ShareGPT training-split first turns (prompt + the source's first
reply fit in --max-seq-len) on one thread, in bf16, with the tapped-feature forward:
  regenerate     the target writes the reply (our decode loop, batched) and a second
                 forward taps its features: what `dflash distill` does today
  teacher-forced one forward over prompt + source reply taps the features and gives the
                 target's greedy next token at every position
Agreement is P(target's greedy next token == the source's next token) over reply
positions, and P(k in a row) for k = 1..7: with target-argmax labels, a block position k
sees the target's own path only while the k-1 source tokens before it agree, so these are
the fractions of block positions such data could supervise without mislabelling.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def first_turns(target, limit: int, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, prompt + source reply ids) of the first usable training-split records."""
    from dflash.data import Reject, normalize_conversation, sample_id, split_of
    from dflash.sources import iter_records

    out = []
    for record in iter_records("sharegpt"):
        try:
            messages = normalize_conversation(record)
        except Reject:
            continue
        if split_of(sample_id(messages), 0.02) != "train" or [m["role"] for m in messages[:2]] != ["user", "assistant"]:
            continue
        prompt = target.chat_ids(messages[:1])
        full = target.chat_ids(messages[:2], add_generation_prompt=False)
        if full[: len(prompt)] == prompt and len(full) <= max_seq_len and len(full) - len(prompt) >= 16:
            out.append((prompt, full))
        if len(out) == limit:
            return out
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-seq-len", type=int, default=640)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from dflash.config import default_target_layer_ids
    from dflash.masks import causal_attention_mask
    from dflash.regenerate import GenerationParams, generate_batch, tapped_hidden
    from dflash.target import load_target

    target = load_target("default", dtype="bf16")
    taps = tuple(default_target_layer_ids(target.num_layers, 5))
    pairs = first_turns(target, args.limit, args.max_seq_len)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len + args.max_new_tokens,
                              max_turns=1)

    t0, regenerated = time.perf_counter(), 0
    for i in range(0, len(pairs), args.batch_size):
        prompts = [p for p, _ in pairs[i: i + args.batch_size]]
        replies = generate_batch(target, prompts, params)
        tapped_hidden(target, [p + r for p, r in zip(prompts, replies)], taps)
        regenerated += sum(len(r) for r in replies)
    regen_s = time.perf_counter() - t0

    t0, forced, agree = time.perf_counter(), 0, []
    for prompt, full in pairs:  # one sequence per forward: no padding, and the logits stay small
        ids = torch.tensor([full])
        n = len(full)
        out = target.forward(ids, torch.arange(n)[None], causal_attention_mask(torch.ones(1, n, dtype=torch.bool)),
                             tap_layer_ids=taps, logits_slice=slice(len(prompt) - 1, n - 1))
        agree.append((out.logits[0].argmax(-1) == ids[0, len(prompt):]).numpy())
        forced += n - len(prompt)
    forced_s = time.perf_counter() - t0

    print(f"{len(pairs)} ShareGPT first turns, bf16, 1 thread, 5 taps")
    print(f"  regenerate      {regenerated:6d} reply tokens in {regen_s:6.1f} s = {regenerated / regen_s:7.1f} tok/s")
    print(f"  teacher-forced  {forced:6d} reply tokens in {forced_s:6.1f} s = {forced / forced_s:7.1f} tok/s"
          f"  ({forced / forced_s / (regenerated / regen_s):.1f}x)")
    print(f"  target greedy == source next token: {np.concatenate(agree).mean():.3f} of reply positions")
    for k in range(1, 8):
        hits = [bool(a[i: i + k].all()) for a in agree for i in range(len(a) - k + 1)]
        print(f"    {k} in a row: {np.mean(hits):.3f}")


if __name__ == "__main__":
    main()
