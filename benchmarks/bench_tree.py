"""One draft per cycle vs draft trees (dflash.tree), side by side in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_tree.py --datasets mt-bench,humaneval,math500 \
        --limit 3 --max-new-tokens 64 --trees 32:4,20:4,12:3

Every decoder uses the shipped reference drafter of the default target with context lookup
and its corpus; "chain" is the default decoder (one draft per cycle), "tree N:K" verifies up
to N tokens per cycle with the drafter's K most likely first tokens as branches. Each
prompt is decoded by AR and every decoder in turn (after a warm-up), so the speedups share
a machine state. Prints tau, tokens/s and speedup over AR per dataset; at T=0 every output
is re-scored teacher-forced and any token more than 0.5 logits below the target's argmax
is reported as LOSSY.
"""

from __future__ import annotations

import argparse

import torch

from dflash.bench import BF16_MARGIN, emitted_token_margins
from dflash.decoding import SpeculativeDecoder
from dflash.pair import DecodeConfig, load_pair
from dflash.prompts import load_prompt_set
from dflash.sampling import SamplingParams
from dflash.tree import TreeConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--trees", default="32:4,20:4", help="comma-separated max_nodes:first_candidates")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    chain = load_pair(DecodeConfig(drafter="default", dtype=args.dtype)).decoder  # with lookup and corpus
    target = chain.target
    decoders = {"ar": SpeculativeDecoder(target), "chain": chain}
    for spec in args.trees.split(","):  # the same loaded parts, verified as trees
        nodes, first = map(int, spec.split(":"))
        decoders[f"tree {spec}"] = SpeculativeDecoder(target, chain.drafter, verify=chain.verify,
                                                      block_size=chain.block_size, lookup=chain.lookup,
                                                      corpus=chain.corpus, tree=TreeConfig(nodes, first))
    for name in args.datasets.split(","):
        prompts = [target.chat_ids(c) for c in load_prompt_set(name)[: args.limit]]
        for dec in decoders.values():
            dec.generate([prompts[0]], SamplingParams(4))
        totals = {k: [0, 0.0, []] for k in decoders}  # tokens, seconds, acceptance lengths
        for i, prompt in enumerate(prompts):
            params = SamplingParams(args.max_new_tokens, temperature=args.temperature, seed=i)
            for key, dec in decoders.items():
                r = dec.generate([prompt], [params])[0]
                totals[key][0] += len(r.output_ids)
                totals[key][1] += r.stats.total_time_s
                totals[key][2] += r.stats.acceptance_lengths
                if args.temperature == 0 and key != "ar":
                    worst = float(emitted_token_margins(target, prompt, r.output_ids).max())
                    if worst > BF16_MARGIN:
                        print(f"LOSSY {name} {key} prompt {i}: {worst:.3f} logits below the argmax")
        ar = totals["ar"][0] / totals["ar"][1]
        for key, (tokens, seconds, lengths) in totals.items():
            tps = tokens / seconds
            print(f"{name:18s} T={args.temperature:g} {key:12s} tau {sum(lengths) / len(lengths):.2f} "
                  f"tok/s {tps:5.1f} speedup {tps / ar:.2f}x", flush=True)


if __name__ == "__main__":
    main()
