"""Training levers side by side at equal optimizer steps: held-out loss, per-position
accuracy and the tau they imply, on the same distilled data, in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_levers.py --data outputs/ref/distill \
        --steps 300 --variants base,rms,target,zero,lr3e-3 --json levers.json

Each variant trains a fresh drafter with the dflash/ objective (the same code Ray Train
runs, without Ray) on every shard but the last, and is scored every --eval-every steps on
the first --eval-rows rows of the last shard with fixed anchors (loss over the draft
vocabulary, top-1 accuracy per block position over all labels). One thread, bf16 by
default: the fast path on these CPUs. `--train-rows N` trains on the first N rows only, so
a few thousand steps run several epochs and show how a lever copes with memorisation
(`--train-rows 176,352,704` runs every variant at each size: a data-scaling curve); the
`taps*` variants read a subset of the stored tapped layers;
the `soft*` variants (logit distillation) first compute the target's top-32 next-token
distribution over those rows, teacher-forced. A lever that wins here is then confirmed by the
true tau of `dflash train ... eval_every=` (speculative decoding of held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

VARIANTS = {  # name -> changes to the base recipe
    "base": {},
    "rms": {"tap_scaling": "rms"},
    "target": {"init": "target"},
    "zero": {"init": "zero_output"},
    "rms+target": {"tap_scaling": "rms", "init": "target"},
    "lr3e-3": {"lr": 3e-3},
    "lr3e-4": {"lr": 3e-4},
    "anchors128": {"num_anchors": 128},
    "block16": {"block_size": 16},
    "vocab4096": {"draft_vocab_size": 4096},
    "layers2": {"num_draft_layers": 2},
    "layers3": {"num_draft_layers": 3},
    "layers4": {"num_draft_layers": 4},
    "soft": {"soft_weight": 1.0},  # logit distillation: CE against the target's top-k distribution
    "soft0.5": {"soft_weight": 0.5},  # half hard labels, half the target's distribution
    "layers3+soft0.5": {"num_draft_layers": 3, "soft_weight": 0.5},
    # taps: which of the distilled tapped layers the drafter reads (indices into the stored
    # taps; the reference data taps layers [1, 8, 14, 20, 27] of 30)
    "taps3": {"taps": (0, 2, 4)},  # [1, 14, 27]
    "taps-late": {"taps": (3, 4)},  # [20, 27]
    "taps-last": {"taps": (4,)},  # [27] only
    "taps-early": {"taps": (0, 1)},  # [1, 8] only
}
BASE = {"lr": 1e-3, "init": "random", "tap_scaling": "none", "num_anchors": 64, "block_size": 8,
        "draft_vocab_size": 8192, "num_draft_layers": 1, "warmup": 20, "soft_weight": 0.0, "taps": None}
SOFT_TOP_K = 32


def head_rows(rows, n):
    """The first n of (ids, masks, hidden) rows, as dflash.training.read_rows gives them."""
    return tuple(x[:n] for x in rows)


def batch(rows, idx=None):
    """The padded MicroBatch of rows idx (all rows if None)."""
    from dflash.training import collate

    ids, masks, hidden = rows
    idx = range(len(ids)) if idx is None else idx
    return collate([ids[i] for i in idx], [masks[i] for i in idx], [hidden[i] for i in idx])


@torch.no_grad()
def target_top_k(target, rows, k=SOFT_TOP_K):
    """Per row (T, k) ids and probabilities of the target's distribution for the token AT
    each position (teacher-forced over the row; position 0 gets a dummy entry)."""
    from dflash.masks import causal_attention_mask

    out = []
    for ids in rows[0]:
        n = len(ids)
        logits = target.forward(torch.as_tensor(ids, dtype=torch.long)[None], torch.arange(n)[None], causal_attention_mask(torch.ones(1, n, dtype=torch.bool)),
                                None).logits[0].float()  # (n, V): row p predicts token p+1
        top = torch.softmax(logits, -1).topk(k, -1)
        ids_k = torch.cat([torch.zeros(1, k, dtype=torch.long), top.indices[:-1]])
        probs_k = torch.cat([torch.zeros(1, k), top.values[:-1]]).to(torch.float16)
        out.append((ids_k, probs_k))
    return out


def soft_batch(soft, idx):
    t = max(len(soft[i][0]) for i in idx)
    ids = torch.zeros(len(idx), t, SOFT_TOP_K, dtype=torch.long)
    probs = torch.zeros(len(idx), t, SOFT_TOP_K, dtype=torch.float16)
    for j, i in enumerate(idx):
        ids[j, : len(soft[i][0])], probs[j, : len(soft[i][0])] = soft[i]
    return ids, probs


def select_taps(taps, subset, d):
    """The chosen taps' columns of (..., n_taps*d) concatenated features (all when subset is None)."""
    if subset is None:
        return taps
    return torch.cat([taps[..., i * d: (i + 1) * d] for i in subset], -1)


def run_variant(name, recipe, target, train_rows, eval_rows, layer_ids, vocab_counts, steps, eval_every, micro, seed,
                soft=None):
    from dflash.config import DrafterConfig
    from dflash.drafter import OutputHead
    from dflash.objective import dflash_loss
    from dflash.training import fixed_anchors, heldout_metrics, most_frequent_tokens, new_drafter, warmup_cosine

    torch.manual_seed(seed)
    subset = recipe["taps"]
    if subset is not None:
        layer_ids = [layer_ids[i] for i in subset]
    cfg = DrafterConfig.for_target(target, recipe["num_draft_layers"],
                                   recipe["block_size"], list(layer_ids), draft_vocab_size=recipe["draft_vocab_size"])
    vocab = most_frequent_tokens(vocab_counts, cfg.draft_vocab_size) if cfg.draft_vocab_size else ()
    drafter = new_drafter(cfg, target, recipe["init"], vocab).to(target.dtype)
    scale = None
    if recipe["tap_scaling"] == "rms":
        scale = select_taps(torch.tensor(recipe["_tap_scale"]), subset, target.config.hidden_size)
    opt = torch.optim.AdamW([p for p in drafter.parameters()], lr=recipe["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps, recipe["warmup"] / steps))
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    g = torch.Generator().manual_seed(seed)
    eval_batch = batch(eval_rows)
    eval_anchors = fixed_anchors(eval_batch)
    history, t0 = [], time.perf_counter()

    def scaled(taps):
        taps = select_taps(taps, subset, target.config.hidden_size)
        return taps.to(target.dtype) if scale is None else (taps.float() * scale).to(target.dtype)

    def evaluate(step):
        row = ({"step": step} | heldout_metrics(drafter, target, eval_batch, scaled(eval_batch.taps), eval_anchors)
               | {"seconds": round(time.perf_counter() - t0, 1)})
        history.append(row)
        print(f"  [{name}] step {step}: eval loss {row['eval_loss']:.3f} implied tau {row['eval_implied_tau']:.3f} "
              f"acc1 {row['eval_accuracy'][0]:.3f} ({row['seconds']:.0f} s)", flush=True)

    drafter.train()
    num_rows = len(train_rows[0])
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    pos = 0
    for step in range(1, steps + 1):
        if pos + micro > len(order):
            order, pos = torch.randperm(num_rows, generator=g).tolist(), 0
        idx = order[pos: pos + micro]
        mb = batch(train_rows, idx)
        pos += micro
        w = recipe["soft_weight"]
        out = dflash_loss(drafter, target.embed, head.logits, mb.input_ids, mb.loss_mask, scaled(mb.taps), mb.valid,
                          num_anchors=recipe["num_anchors"], generator=g, label_index=head.index,
                          soft_labels=soft_batch(soft, idx) if w else None, soft_weight=w)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a `dflash distill` output directory with taps")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-rows", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--train-rows", default="0", help="train on only the first N rows (0 = all): a small set "
                    "shows how a lever copes with memorisation within a few epochs; a comma list (176,352,704) "
                    "runs every variant at every size, each with the draft vocabulary of its own rows")
    ap.add_argument("--variants", default="base,rms,target,zero")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from dflash.data import read_dataset_metadata, shard_files
    from dflash.target import load_target
    from dflash.training import read_rows, tap_rms_scale, token_counts

    files = shard_files(args.data)
    if len(files) < 2:
        raise SystemExit(f"{args.data}: need at least two shards (train on all but the last, score on the last)")
    meta = read_dataset_metadata(args.data)
    target = load_target("default", dtype=args.dtype)
    sizes = [int(n) for n in args.train_rows.split(",")]
    train_rows = read_rows(files[:-1], with_hidden=True, max_rows=None if 0 in sizes else max(sizes))
    eval_rows = read_rows(files[-1:], with_hidden=True, max_rows=args.eval_rows)
    sizes = [n or len(train_rows[0]) for n in sizes]
    tap_scale = tap_rms_scale(files[:-1])
    print(f"{len(train_rows[0])} training rows loaded, {len(eval_rows[0])} held-out rows, "
          f"taps {list(meta.target_layer_ids)}, {args.dtype}, {args.threads} thread(s)", flush=True)
    names = args.variants.split(",")
    soft = None
    if any((BASE | VARIANTS[n])["soft_weight"] for n in names):
        t0 = time.perf_counter()
        soft = target_top_k(target, train_rows)
        print(f"target top-{SOFT_TOP_K} distributions of the training rows: {time.perf_counter() - t0:.0f} s", flush=True)
    results = {}
    for n in sizes:
        rows = head_rows(train_rows, n)
        counts = token_counts(rows[0], rows[1], target.vocab_size)  # never the held-out rows
        print(f"{n} training rows: {int(counts.sum())} response tokens", flush=True)
        for name in names:
            key = name if len(sizes) == 1 else f"{name}@{n}"
            recipe = BASE | VARIANTS[name] | {"_tap_scale": tap_scale}
            print(f"{key}: {VARIANTS[name] or 'the base recipe'}", flush=True)
            results[key] = run_variant(key, recipe, target, rows, eval_rows, meta.target_layer_ids, counts,
                                       args.steps, args.eval_every, args.micro_batch, args.seed, soft)
    print("\n| variant | eval loss | implied tau | acc k=1 | acc k=2 | acc k=3 | best implied tau (step) | seconds |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, hist in results.items():
        last, best = hist[-1], max(hist, key=lambda r: r["eval_implied_tau"])
        a = last["eval_accuracy"]
        print(f"| {name} | {last['eval_loss']:.3f} | {last['eval_implied_tau']:.3f} | {a[0]:.3f} | {a[1]:.3f} | "
              f"{a[2]:.3f} | {best['eval_implied_tau']:.3f} ({best['step']}) | {last['seconds']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": BASE, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
