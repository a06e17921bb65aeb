"""How far the reference recipe goes with more training compute: one device, no Ray, a
time budget instead of a step count. An experiment, not the trainer (that is `dflash train`).

    python benchmarks/train_device.py --data DIR --out DRAFTER_DIR --device cuda --seconds 200

Trains a drafter on a tokens-only `dflash distill` directory (online features from the frozen
target, as `dflash train mode=online` does) with the dflash/ objective, the recipe of
jobs/configs/reference/train.yaml unless overridden, and micro-batches of --batch sequences.
The cosine schedule is sized after the first --probe-steps from the step rate of their
second half, so the run ends inside --seconds. The last --heldout-rows rows are held out: every --eval-every steps it
reports loss, per-position accuracy and the tau they imply on fixed anchors. Writes the
drafter (public layout, bf16) and train_log.jsonl to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--init", default="target", choices=["random", "target", "zero_output"])
    ap.add_argument("--max-seq-len", type=int, default=640)
    ap.add_argument("--probe-steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-rows", type=int, default=64, help="the last rows of --data, never trained on")
    ap.add_argument("--eval-only", default=None, help="comma-separated drafter dirs: score them on the held-out "
                    "rows and train nothing")
    args = ap.parse_args()

    from dflash.checkpoint import load_drafter, save_drafter
    from dflash.config import DrafterConfig, default_target_layer_ids
    from dflash.data import shard_files
    from dflash.drafter import OutputHead
    from dflash.objective import dflash_loss
    from dflash.target import load_target
    from dflash.training import (collate, fixed_anchors, heldout_metrics, most_frequent_tokens, new_drafter,
                                 read_rows, round_to_storage, target_features, token_counts, warmup_cosine)

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    target = load_target("default", device=args.device, dtype="bf16")
    ids, masks, _ = read_rows(shard_files(args.data))  # whole rows: the draft vocabulary counts them all
    rows = [(i[: args.max_seq_len], m[: args.max_seq_len]) for i, m in zip(ids, masks)]
    if len(rows) < 2 * args.heldout_rows:
        raise SystemExit(f"{args.data}: {len(rows)} rows; need at least {2 * args.heldout_rows} "
                         f"(the last --heldout-rows {args.heldout_rows} are held out)")
    held, train = rows[-args.heldout_rows:], rows[: -args.heldout_rows]
    layer_ids = default_target_layer_ids(target.num_layers, 5)

    def features(mb):
        return round_to_storage(target_features(target, mb.input_ids, mb.valid, layer_ids))

    hb = collate([r[0] for r in held], [r[1] for r in held], None)
    held_taps, held_anchors = features(hb), fixed_anchors(hb)

    def heldout(drafter) -> dict:
        """Loss and per-position accuracy on the held-out rows at fixed anchors (teacher-forced)."""
        return heldout_metrics(drafter, target, hb, held_taps, held_anchors, autocast=torch.bfloat16)

    if args.eval_only:
        for d in args.eval_only.split(","):
            drafter = load_drafter(d, target, device=args.device).float()
            if list(drafter.config.target_layer_ids) != list(layer_ids):
                raise SystemExit(f"{d}: taps {drafter.config.target_layer_ids}, this evaluation computes {layer_ids}")
            print(json.dumps({"drafter": d} | heldout(drafter)))
        return
    counts = token_counts(ids, masks, target.vocab_size)
    torch.manual_seed(args.seed)
    cfg = DrafterConfig.for_target(target, args.layers, args.block_size, layer_ids, draft_vocab_size=args.vocab)
    drafter = new_drafter(cfg, target, args.init, most_frequent_tokens(counts, args.vocab)).to(dev)
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    warm = max(1, args.probe_steps)
    total = 10 ** 9  # until the probe steps have measured the step rate
    factor = lambda s: min(1.0, (s + 1) / warm)  # linear warm-up over the probe steps, then cosine

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor(s))
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = open(out_dir / "train_log.jsonl", "w")

    def evaluate(step, seconds):
        row = {"step": step} | heldout(drafter) | {"seconds": round(seconds, 1), "total_steps": total}
        acc = row["eval_accuracy"]
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"step {step}/{total}: eval loss {row['eval_loss']:.3f} implied tau {row['eval_implied_tau']:.3f} "
              f"acc {acc[:4]} ({seconds:.0f}s)", flush=True)

    print(f"{len(train)} training rows, {len(held)} held out; setup {time.perf_counter() - t_start:.0f}s", flush=True)
    order = sorted(range(len(train)), key=lambda i: len(train[i][0]))  # length buckets of --batch rows
    groups = [order[i: i + args.batch] for i in range(0, len(order), args.batch)]
    t0 = time.perf_counter()
    step, epoch, t_half = 0, 0, 0.0
    drafter.train()
    while step < total:
        rng.shuffle(groups)
        for g in groups:
            mb = collate([train[i][0] for i in g], [train[i][1] for i in g], None)
            taps = features(mb)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                out = dflash_loss(drafter, target.embed, head.logits, mb.input_ids.to(dev), mb.loss_mask.to(dev),
                                  taps, mb.valid.to(dev), num_anchors=args.anchors, generator=gen,
                                  label_index=head.index)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            elapsed = time.perf_counter() - t0
            if step == args.probe_steps // 2:
                t_half = elapsed  # the first steps include warm-up (allocator, kernels): not timed
            if step == args.probe_steps:
                rate = (step - args.probe_steps // 2) / max(elapsed - t_half, 1e-9)
                total = max(step + 1, int(rate * (args.seconds - (time.perf_counter() - t_start))))
                factor = warmup_cosine(total, warm / total)
                print(f"{rate:.1f} steps/s: schedule set to {total} steps", flush=True)
            if step % 50 == 0:
                log.write(json.dumps({"step": step, "loss": round(out.loss.item(), 4), "epoch": epoch,
                                      "lr": sched.get_last_lr()[0]}) + "\n")
            if step % args.eval_every == 0:
                evaluate(step, elapsed)
            if step >= total:
                break
        epoch += 1
    evaluate(step, time.perf_counter() - t0)
    save_drafter(drafter.float().cpu(), out_dir, dtype="bf16")
    (out_dir / "training.json").write_text(json.dumps(vars(args) | {"steps": step, "epochs": epoch,
                                                                     "train_rows": len(train)}, indent=1))
    print(f"saved {out_dir} after {step} steps ({epoch} epochs)", flush=True)


if __name__ == "__main__":
    main()
