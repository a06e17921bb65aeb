"""Drafter depth at equal wall time: acceptance by block position, training subset and held
out, and what each depth costs per draft at decode time (issue 32).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_depth.py --data outputs/ref/distill_tf \
        --layers 1,2,3,5 --seconds 1200 --out outputs/depth

Every variant trains a fresh drafter with the dflash/ objective for the same --seconds of
training (evaluation excluded) on every shard of --data but the last, with offline
features, fp32 weights under bf16 autocast (what DeepSpeed's bf16 does), AdamW, a cosine
schedule over wall time, micro-batches of --micro-batch rows drawn in a fresh random order
every epoch. Teacher-forced data (`responses: source`) trains on the target's greedy
tokens where the block follows the target's path (dflash.masks.block_labels).

Reported per variant, at 1/3, 2/3 and the end of its time: top-1 accuracy for k = 1..7 at
fixed anchors on --eval-rows rows of the last shard (held out) and of the first training
rows (training subset), the tau they imply, the steps run, and the decode-time cost of
one draft (a block of --decode-block at a 512-token context, median of 30, one thread) next
to a one-token step of the target. Each drafter is saved under --out/<variant> (public
layout) for `dflash bench --drafter`, which gives the true tau and speedup.
`--eval-only DIR,...` scores existing drafters (the shipped one) on the same rows instead.

Memory: the training rows' features live in RAM (~6 GB for 640 rows cut at 1024 tokens),
and glibc keeps the freed buffers of variable-length batches: a process grew ~0.7 GB/min,
~0.07 GB/min when started with MALLOC_MMAP_THRESHOLD_=1048576 (large buffers go back to the OS).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch


def load_rows(files, max_seq_len, max_rows=None, keep_taps=None):
    """(ids, masks, hidden, labels) per-row lists over shard files (labels None for regenerated data);
    keep_taps (n_stored, [positions]) keeps only those of the n_stored taps each row carries."""
    import pyarrow.parquet as pq

    from dflash.training import label_rows, table_rows

    rows = ([], [], [], [])
    for f in files:
        table = pq.read_table(f)
        ids, masks, hidden = table_rows(table, max_seq_len, with_hidden=True)
        if keep_taps is not None:
            n, keep = keep_taps
            hidden = [h.reshape(len(h), n, -1)[:, keep].reshape(len(h), -1) for h in hidden]
        hidden = [h.copy() for h in hidden]  # own the cut rows: views would keep whole shards in memory
        labels = label_rows(table, max_seq_len)
        del table
        for out, part in zip(rows, (ids, masks, hidden, labels or [None] * len(ids))):
            out.extend(part)
        if max_rows and len(rows[0]) >= max_rows:
            break
    return tuple(r[:max_rows] for r in rows)


def micro_batch(rows, idx):
    from dflash.training import collate

    ids, masks, hidden, labels = rows
    pick = lambda xs: [xs[i] for i in idx]
    return collate(pick(ids), pick(masks), pick(hidden), pick(labels) if labels[0] is not None else None)


@torch.no_grad()
def draft_cost_ms(drafter, target, block: int, context: int = 512, repeats: int = 30) -> float:
    """Median ms of one decode-time draft: context KV of the newest tokens' taps is already
    cached, so one block through the drafter plus its head over the draft vocabulary."""
    from dflash.drafter import OutputHead

    drafter.eval()
    taps = torch.randn(1, context, drafter.fc.in_features) * 0.1
    ctx = drafter.context_kv(taps, torch.arange(context)[None])
    emb = target.embed(torch.full((1, block), drafter.config.mask_token_id))
    pos = torch.arange(context, context + block)[None]
    mask = torch.ones(1, 1, block, context + block, dtype=torch.bool)
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            head.logits(drafter(emb, pos, ctx, mask)).argmax(-1)
        times.append(time.perf_counter() - t0)
    drafter.train()
    return 1000 * statistics.median(times[3:])


@torch.no_grad()
def target_step_ms(target, context: int = 512, repeats: int = 30) -> float:
    """Median ms of the target's one-token step at a `context`-token cache."""
    from transformers import DynamicCache

    from dflash.masks import causal_attention_mask

    cache = DynamicCache(config=target.config)
    ids = torch.randint(0, 1000, (1, context))
    target.forward(ids, torch.arange(context)[None], causal_attention_mask(torch.ones(1, context, dtype=torch.bool)),
                   cache)
    times = []
    mask = torch.ones(1, 1, 1, context + 1, dtype=torch.bool)
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        target.forward(ids[:, :1], torch.tensor([[context]]), mask, cache, logits_slice=slice(-1, None))
        cache.crop(-1)  # drop the step again: every step sees the same context
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a `dflash distill` directory with taps (regenerated or source)")
    ap.add_argument("--layers", default="1,2,3,5", help="draft layers per variant")
    ap.add_argument("--taps", default=None, help="comma-separated target layers the drafters read, a subset of "
                    "the data's (default: all of them); e.g. 1,8,14,20,28 on data tapped at 1,8,14,20,27,28")
    ap.add_argument("--seconds", type=float, default=600, help="training time per variant")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--anchors", type=int, default=128, help="blocks per sequence per step")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--decode-block", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--train-rows", type=int, default=0, help="train on the first N rows only (0: all)")
    ap.add_argument("--eval-rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-only", default=None, help="comma-separated drafter dirs (e.g. the shipped one): score "
                    "them on the same held-out and training rows, train nothing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dflash.checkpoint import load_drafter, save_drafter
    from dflash.config import DrafterConfig
    from dflash.data import read_dataset_metadata, shard_files
    from dflash.drafter import OutputHead
    from dflash.objective import dflash_loss
    from dflash.target import load_target
    from dflash.training import fixed_anchors, heldout_metrics, most_frequent_tokens, new_drafter, token_counts

    files = shard_files(args.data)
    if len(files) < 2:
        raise SystemExit(f"{args.data}: need at least two shards (train on all but the last, score on the last)")
    meta = read_dataset_metadata(args.data)
    target = load_target("default", dtype="bf16")
    t0 = time.perf_counter()
    taps = [int(x) for x in args.taps.split(",")] if args.taps else list(meta.target_layer_ids)
    missing = sorted(set(taps) - set(meta.target_layer_ids))
    if missing:
        raise SystemExit(f"{args.data}: taps {missing} not in the data's {list(meta.target_layer_ids)}")
    keep = (len(meta.target_layer_ids), [meta.target_layer_ids.index(l) for l in taps])
    train = load_rows(files[:-1], args.max_seq_len, args.eval_rows if args.eval_only else (args.train_rows or None),
                      keep)
    held = load_rows(files[-1:], args.max_seq_len, args.eval_rows, keep)
    counts = token_counts(train[0], train[1], target.vocab_size)
    vocab = most_frequent_tokens(counts, args.vocab)
    n_resp = int(sum(int(m.sum()) for m in train[1]))
    print(f"{len(train[0])} training rows ({n_resp} response tokens, responses {meta.responses}), "
          f"{len(held[0])} held-out rows, loaded in {time.perf_counter() - t0:.0f} s; {args.seconds:.0f} s per variant, "
          f"{args.threads} thread(s)", flush=True)
    eval_sets = {"heldout": micro_batch(held, range(len(held[0]))),
                 "train": micro_batch(train, range(min(args.eval_rows, len(train[0]))))}
    eval_anchors = {k: fixed_anchors(b) for k, b in eval_sets.items()}
    if args.eval_only:
        for d in args.eval_only.split(","):
            drafter = load_drafter(d, target)
            row = {"drafter": d, "layers": drafter.config.num_hidden_layers}
            for k, b in eval_sets.items():
                m = heldout_metrics(drafter, target, b, b.taps.float(), eval_anchors[k], autocast=torch.bfloat16)
                row[f"{k}_accuracy"], row[f"{k}_implied_tau"] = m["eval_accuracy"], m["eval_implied_tau"]
            print(json.dumps(row), flush=True)
        return
    step_ms = target_step_ms(target)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"data": args.data, "responses": meta.responses, "taps": taps, "train_rows": len(train[0]),
               "train_response_tokens": n_resp, "seconds": args.seconds, "target_step_ms": round(step_ms, 2),
               "args": vars(args), "variants": {}}

    for layers in [int(x) for x in args.layers.split(",")]:
        name = f"layers{layers}" + (f"-taps{'_'.join(map(str, taps))}" if args.taps else "")
        torch.manual_seed(args.seed)
        cfg = DrafterConfig.for_target(target, layers, args.block_size, taps,
                                       draft_vocab_size=args.vocab, decode_block_size=args.decode_block)
        drafter = new_drafter(cfg, target, "random", vocab)
        head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
        opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
        gen, rng = torch.Generator().manual_seed(args.seed), random.Random(args.seed)
        order, pos, step, trained_s, history = [], 0, 0, 0.0, []
        checkpoints = [args.seconds / 3, 2 * args.seconds / 3, args.seconds]

        def evaluate():
            row = {"step": step, "seconds": round(trained_s, 1)}
            for k, b in eval_sets.items():
                m = heldout_metrics(drafter, target, b, b.taps.float(), eval_anchors[k], autocast=torch.bfloat16)
                row[f"{k}_accuracy"] = m["eval_accuracy"]
                row[f"{k}_implied_tau"] = m["eval_implied_tau"]
            history.append(row)
            print(f"  [{name}] step {step} ({trained_s:.0f} s): held-out acc {row['heldout_accuracy'][:4]} "
                  f"implied tau {row['heldout_implied_tau']:.3f}; training subset acc {row['train_accuracy'][:4]}",
                  flush=True)

        drafter.train()
        while trained_s < args.seconds:
            if pos + args.micro_batch > len(order):
                order, pos = list(range(len(train[0]))), 0
                rng.shuffle(order)  # a fresh order every epoch
            mb = micro_batch(train, order[pos: pos + args.micro_batch])
            pos += args.micro_batch
            t_step = time.perf_counter()
            frac = trained_s / args.seconds  # the schedule runs on training time
            lr = args.lr * (min(1.0, frac / 0.02) if frac < 0.02 else 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = dflash_loss(drafter, target.embed, head.logits, mb.input_ids, mb.loss_mask, mb.taps.float(),
                                  mb.valid, num_anchors=args.anchors, generator=gen, label_index=head.index,
                                  target_ids=mb.target_ids)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            step += 1
            trained_s += time.perf_counter() - t_step
            if checkpoints and trained_s >= checkpoints[0]:
                checkpoints.pop(0)
                evaluate()
        cost = draft_cost_ms(drafter, target, args.decode_block)
        save_drafter(drafter.cpu(), out_dir / name, dtype="bf16")
        last = history[-1]
        results["variants"][name] = {"layers": layers, "steps": step, "draft_ms": round(cost, 2),
                                     "draft_per_target_step": round(cost / step_ms, 3), "history": history}
        print(f"{name}: {step} steps, draft {cost:.1f} ms = {cost / step_ms:.2f} target steps; held-out implied "
              f"tau {last['heldout_implied_tau']:.3f}", flush=True)
        (out_dir / "depth.json").write_text(json.dumps(results, indent=1))

    print(f"\ntarget one-token step {step_ms:.1f} ms at a 512-token context; {results['train_rows']} rows, "
          f"{n_resp} response tokens ({meta.responses}), {args.seconds:.0f} s of training each\n")
    print("| layers | steps | held-out acc k=1..7 | implied tau | training-subset acc k=1..3 | draft ms (x step) |\n"
          "|---|---|---|---|---|---|")
    for name, v in results["variants"].items():
        h = v["history"][-1]
        acc = " / ".join(f"{a:.2f}" for a in h["heldout_accuracy"][:7])
        tr = " / ".join(f"{a:.2f}" for a in h["train_accuracy"][:3])
        print(f"| {v['layers']} | {v['steps']} | {acc} | {h['heldout_implied_tau']:.2f} | {tr} | "
              f"{v['draft_ms']:.1f} ({v['draft_per_target_step']:.2f}x) |")


if __name__ == "__main__":
    main()
