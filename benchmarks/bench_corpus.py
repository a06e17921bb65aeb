"""How much corpus lookup buys, against the size of the corpus: a teacher-forced replay.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_corpus.py --datasets mt-bench,humaneval \
        --limit 20 --max-new-tokens 128 --fractions 0,0.25,0.5,1 [--corpus A,B] [--teacher-forced DIR]

The target answers each held-out prompt greedily once (bf16, our decode loop); then each
corpus variant replays those answers the way the decoder drafts at T = 0 without a
drafter: context lookup first (dflash.lookup), else corpus lookup, and each cycle accepts
the longest prefix of the proposal that matches the target's answer, plus one token (a
cycle with no proposal is an AR step). Reported per variant: corpus entries, the share of
cycles the corpus drafted, the tokens such a cycle accepted, and the lookup-only tau
(tokens per cycle). The drafter is left out on purpose, so the figures say what the corpus
alone adds.

Variants: each --fractions share of the first --corpus file's answers (the prompts the
distillation saw first); every further --corpus file whole; with --teacher-forced, a table
keyed on a teacher-forced set's source replies and continued by the target's argmax after
each position (`responses: source` data), alone and added to the first corpus.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def replay(answer_context: list[int], answer: list[int], corpus, num_tokens: int) -> dict:
    """Cycles of context-then-corpus lookup over one answer, accepting against the answer."""
    from dflash.lookup import LookupConfig, NgramIndex

    index = NgramIndex(LookupConfig(num_tokens=num_tokens), answer_context)
    i, cycles, corpus_cycles, corpus_tokens = 0, 0, 0, 0
    while i < len(answer):
        proposal = index.propose()
        source = "context"
        if proposal is None and corpus is not None:
            proposal, source = corpus.propose(index.tokens), "corpus"
        accepted = 0
        for tok in proposal or []:
            if i + accepted < len(answer) and answer[i + accepted] == tok:
                accepted += 1
            else:
                break
        step = min(accepted + 1, len(answer) - i)
        if proposal is not None and source == "corpus":
            corpus_cycles += 1
            corpus_tokens += step
        index.extend(answer[i:i + step])
        i += step
        cycles += 1
    return {"tokens": len(answer), "cycles": cycles, "corpus_cycles": corpus_cycles, "corpus_tokens": corpus_tokens}


def answers(stored: dict) -> list[list[int]]:
    """The answer segments of a loaded corpus file."""
    offsets = stored["offsets"].astype(np.int64)
    return [stored["tokens"][a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def tf_pairs(directory: str) -> list[tuple[list[int], list[int]]]:
    """(source tokens, the target's argmax after each) for every reply span of a teacher-forced set."""
    import pyarrow.parquet as pq

    from dflash.data import shard_files

    out = []
    for f in shard_files(directory):
        t = pq.read_table(f, columns=["input_ids", "loss_mask", "target_ids"])
        for ids, mask, tgt in zip(*(t.column(c).to_pylist() for c in ("input_ids", "loss_mask", "target_ids"))):
            m = np.asarray(mask, dtype=bool)
            on = np.flatnonzero(m)
            if len(on) == 0:
                continue
            a, b = max(int(on[0]) - 3, 0), len(ids)
            # the target's argmax after ids[:t+1] is target_ids[t+1]
            out.append((list(ids[a:b - 1]), list(tgt[a + 1:b])))
    return out


def build_index(segs, vocab: int, num_tokens: int):
    """A CorpusIndex over plain segments, or over (tokens, next tokens) pairs mixed in."""
    import dflash.corpus
    from dflash.corpus import CorpusIndex, _most_frequent_next, _window_keys

    if not any(isinstance(s, tuple) for s in segs):
        return CorpusIndex.from_segments(segs, vocab, num_tokens)
    pairs = [s if isinstance(s, tuple) else (s[:-1], s[1:]) for s in segs]
    pairs = [p for p in pairs if len(p[0])]
    index = CorpusIndex.from_segments([[0]], vocab, num_tokens)
    toks = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in pairs])
    nxt = np.concatenate([np.asarray(p[1], dtype=np.int64) for p in pairs])
    seg = np.concatenate([np.full(len(p[0]), i) for i, p in enumerate(pairs)])
    for n in dflash.corpus.ORDERS:  # window toks[s : s+n] -> nxt[s+n-1], inside one segment
        s = np.arange(max(len(toks) - n + 1, 0))
        s = s[seg[s] == seg[s + n - 1]]
        index.tables[n] = _most_frequent_next(_window_keys(toks, s, n, vocab), nxt[s + n - 1])
    return index


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", default="mt-bench,humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--corpus", default="dflash/drafters/SmolLM2-135M-Instruct/corpus/corpus.safetensors",
                    help="comma-separated corpus files (`dflash corpus`)")
    ap.add_argument("--fractions", default="0,0.25,0.5,1", help="shares of the first corpus's answers to keep")
    ap.add_argument("--teacher-forced", default="", help="a teacher-forced distilled directory (target_ids): "
                    "a variant keyed on its source text, continued by the target's argmax")
    ap.add_argument("--orders", default="", help="n-gram orders to key on, longest first (default: "
                    "dflash.corpus.ORDERS), e.g. 5,4,3")
    ap.add_argument("--lookup-tokens", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from safetensors.numpy import load_file

    from dflash.decoding import SamplingParams, SpeculativeDecoder
    from dflash.prompts import load_prompt_set
    from dflash.target import load_target

    torch.set_num_threads(args.threads)
    if args.orders:  # an experiment: the module constant that CorpusIndex reads
        import dflash.corpus

        dflash.corpus.ORDERS = tuple(int(n) for n in args.orders.split(","))
    target = load_target("default", dtype="bf16")
    vocab = target.model.config.vocab_size
    sets = {}
    t0 = time.time()
    for name in args.datasets.split(","):
        prompts = [target.chat_ids(conv[:1]) for conv in load_prompt_set(name)[:args.limit]]
        out = SpeculativeDecoder(target).generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        sets[name] = [(p, r.output_ids) for p, r in zip(prompts, out)]
    print(f"[bench_corpus] answers in {time.time() - t0:.0f} s", flush=True)

    files = args.corpus.split(",")
    segments = [answers(load_file(f)) for f in files]
    variants = [(f"{float(f):g} of {files[0]}", segments[0][:round(float(f) * len(segments[0]))])
                for f in args.fractions.split(",")]
    variants += [(f, segs) for f, segs in zip(files[1:], segments[1:])]
    if args.teacher_forced:
        variants.append(("teacher-forced", tf_pairs(args.teacher_forced)))
        variants.append(("first corpus + teacher-forced", segments[0] + variants[-1][1]))
    for label, segs in variants:
        corpus = build_index(segs, vocab, args.lookup_tokens) if segs else None
        row = {"corpus": label, "answers": len(segs),
               "corpus_tokens": sum(len(x[0]) if isinstance(x, tuple) else len(x) for x in segs),
               "entries": corpus.num_entries if corpus else 0}
        for name, pairs in sets.items():
            tot = {"tokens": 0, "cycles": 0, "corpus_cycles": 0, "corpus_tokens": 0}
            for prompt, answer in pairs:
                for k, v in replay(prompt, answer, corpus, args.lookup_tokens).items():
                    tot[k] += v
            row[name] = {"tau": round(tot["tokens"] / tot["cycles"], 3),
                         "corpus_cycle_share": round(tot["corpus_cycles"] / tot["cycles"], 3),
                         "tokens_per_corpus_cycle": round(tot["corpus_tokens"] / max(tot["corpus_cycles"], 1), 3)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
