"""One Ray Train worker: the frozen target, a DeepSpeed engine around the drafter and its
loss (dflash.training.DrafterObjective), and the loop over this worker's data shard.

Lifecycle (TrainWorker.run, called by `train_loop_per_worker` on every rank):
    setup()        load the target, build the drafter and its engine, restore the latest
                   checkpoint into `progress` (a fresh run starts at step 0)
    train_epoch()  one pass over the shard: forward/backward per micro-batch, one optimizer
                   step per grad_accum micro-batches, then end_step()
    end_step()     metrics (summed over workers), evaluate() when due, save() when due
    evaluate()     the true tau: rank 0 decodes held-out prompts with the current drafter
    save()         ZeRO shards + train_state.json, handed to ray.train.report
Ray appears only at get_dataset_shard and report(checkpoint); the rest is dflash/ and
DeepSpeed. Resuming: `progress` says which micro-batch of which epoch comes next, so a
restarted group skips what the checkpoint has already trained on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.checkpoint import load_drafter
from dflash.config import DrafterConfig
from dflash.drafter import DFlashDrafter
from dflash.objective import implied_tau
from dflash.training import (DrafterObjective, fold_tap_scale, new_drafter, round_to_storage, target_features,
                             warmup_cosine)
from pipelines.safe_load import weights_only_loads
from pipelines.train_config import (DS_DIR, DS_TAG, METRICS_NAME, STATE_NAME, TrainConfig, TrainPlan,
                                    load_eval_prompts)
from pipelines.train_data import epoch_dataset_name, micro_batches


def train_loop_per_worker(loop_config: dict) -> None:
    """Ray Train's entry point on every rank: {"cfg": TrainConfig, "plan": TrainPlan}."""
    TrainWorker(loop_config["cfg"], loop_config["plan"]).run()


@dataclass
class Progress:
    """Where the run stands: optimizer steps taken, and the next micro-batch to train on
    (index `micro` of epoch `epoch`). Saved in every checkpoint, restored on restart."""

    step: int = 0
    epoch: int = 0
    micro: int = 0


class InjectedFailure(RuntimeError):
    """Raised by the last rank after TrainConfig.fail_at_step (fault injection for tests)."""


class TrainWorker:
    """One rank's training run; `run` is the lifecycle in the module docstring."""

    def __init__(self, cfg: TrainConfig, plan: TrainPlan):
        self.cfg, self.plan = cfg, plan
        self.micro_per_epoch = plan.steps_per_epoch * cfg.grad_accum
        self.progress = Progress()
        self.saved_step: int | None = None  # the step of the latest checkpoint (restored or saved)
        self.metrics: dict = {}  # of the latest optimizer step

    def run(self) -> None:
        self.setup()
        while self.progress.step < self.plan.total_steps:
            self.train_epoch()
        if self.saved_step != self.progress.step:  # e.g. resumed at the end: no step was left
            self.save(self.metrics or {"step": self.progress.step})

    # --- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        import deepspeed
        import ray.train

        from dflash.target import load_target

        cfg, plan = self.cfg, self.plan
        torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = f"cuda:{ctx.get_local_rank()}" if cfg.use_gpu else "cpu"
        self.target = load_target(cfg.target, device=self.device, dtype=cfg.precision)
        torch.manual_seed(cfg.seed)
        if plan.init_from:  # continue a trained drafter (its checks ran in plan_run)
            drafter = load_drafter(plan.init_from, self.target).train()
        else:
            drafter = new_drafter(plan.drafter, self.target, cfg.init, plan.draft_vocab)
        model = DrafterObjective(drafter.to(self.device), self.target, cfg.num_anchors, cfg.gamma, plan.tap_scale)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(plan.total_steps, cfg.warmup_ratio))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=self.scheduler,
                                                    config=deepspeed_config(cfg), dist_init_required=False)
        self.restore(ray.train.get_checkpoint())
        self.num_nodes = count_nodes()
        self.prompts = [self.target.chat_ids(c) for c in load_eval_prompts(cfg)] if self.rank == 0 else None
        self.log = MetricLogger(Path(plan.run_dir) / METRICS_NAME, enabled=self.rank == 0)
        if self.saved_step is not None:
            self.log.write({"event": "resumed", "step": self.progress.step})
        self.engine.train()

    def restore(self, checkpoint) -> None:
        if not checkpoint:
            return
        with checkpoint.as_directory() as d, weights_only_loads():  # resuming runs no pickled code
            self.engine.load_checkpoint(os.path.join(d, DS_DIR), tag=DS_TAG)
            state = json.loads(Path(d, STATE_NAME).read_text())
        self.progress = Progress(state["step"], state["epoch"], state["micro_in_epoch"])
        self.saved_step = state["step"]

    # --- training ----------------------------------------------------------------------------

    def train_epoch(self) -> None:
        """One pass over this epoch's shard (its file order), from micro-batch `progress.micro`
        of `progress.epoch`."""
        import ray.train

        cfg, p = self.cfg, self.progress
        skip, stats = p.micro, StepStats(self.plan.drafter.block_size)
        shard = ray.train.get_dataset_shard(epoch_dataset_name(p.epoch, self.plan.file_orders))
        batches = micro_batches(shard, micro_batch_size=cfg.micro_batch_size, bucket_batches=cfg.bucket_batches,
                                max_seq_len=cfg.max_seq_len, offline=cfg.offline, seed=cfg.seed * 1000 + p.epoch)
        for i, mb in enumerate(batches):
            if i >= self.micro_per_epoch or p.step >= self.plan.total_steps:
                break
            if i < skip:  # trained on before the restart
                continue
            if i % cfg.grad_accum == 0:
                lr = self.scheduler.get_last_lr()[0]  # the rate this optimizer step uses
            stats.add(self.forward_backward(mb, i), mb)
            if (i + 1) % cfg.grad_accum == 0:
                p.step, p.micro = p.step + 1, i + 1
                self.end_step(stats, lr)
                stats = StepStats(self.plan.drafter.block_size)
        p.epoch, p.micro = p.epoch + 1, 0

    def forward_backward(self, mb, i: int):
        """Loss of micro-batch i of this epoch, backward, and the engine's step (which
        updates the weights only at the end of each grad_accum group)."""
        cfg, target, dev = self.cfg, self.target, self.device
        taps = mb.taps if cfg.offline else round_to_storage(
            target_features(target, mb.input_ids, mb.valid, self.plan.drafter.target_layer_ids))
        seed = ((cfg.seed * 1_000_003 + self.progress.epoch) * 1_000_003 + i) * 4099 + self.rank
        labels = mb.target_ids.to(dev) if mb.target_ids is not None else None  # teacher-forced data
        out = self.engine(mb.input_ids.to(dev), mb.loss_mask.to(dev), taps.to(dev, target.dtype), mb.valid.to(dev),
                          torch.Generator().manual_seed(seed), labels)
        self.engine.backward(out.loss)
        self.engine.step()
        return out

    def end_step(self, stats: StepStats, lr: float) -> None:
        cfg, step = self.cfg, self.progress.step
        self.metrics = stats.reduce(step, self.progress.epoch, lr, self.world, self.device, self.num_nodes)
        last = step == self.plan.total_steps
        if (cfg.eval_every and step % cfg.eval_every == 0) or (last and cfg.eval_at_end):
            tau = self.evaluate()
            if tau is not None:
                self.metrics["eval_tau"] = tau
        self.log.write(self.metrics)
        if step % cfg.checkpoint_every == 0 or last:
            self.save(self.metrics)
        if step == cfg.fail_at_step and self.rank == self.world - 1:
            fail_once(Path(self.plan.run_dir) / f".failed_at_{step}")

    # --- evaluation and checkpoints -----------------------------------------------------------

    def evaluate(self) -> float | None:
        """Rank 0's true tau with the current drafter (None on other ranks). Collective:
        under ZeRO-3 every rank takes part in gathering the drafter."""
        import torch.distributed as dist

        objective = self.engine.module
        copy = full_drafter(objective.drafter, self.plan.drafter, self.cfg.zero_stage, build=self.rank == 0)
        tau = None
        if self.rank == 0:
            fold_tap_scale(copy, objective.tap_scale)
            tau = evaluate_tau(self.target, copy, self.prompts, self.cfg.eval_max_new_tokens)
        dist.barrier()
        return tau

    def save(self, metrics: dict) -> None:
        """A checkpoint of every rank's ZeRO shards; rank 0 adds train_state.json with the
        point to resume from (the next micro-batch, or the next epoch's first)."""
        import ray.train

        p = self.progress
        epoch, micro = (p.epoch + 1, 0) if p.micro == self.micro_per_epoch else (p.epoch, p.micro)
        tmp = tempfile.mkdtemp(prefix="dflash-ckpt-")
        self.engine.save_checkpoint(os.path.join(tmp, DS_DIR), tag=DS_TAG)
        if self.rank == 0:
            state = {"step": p.step, "epoch": epoch, "micro_in_epoch": micro, "total_steps": self.plan.total_steps,
                     "drafter_config": self.plan.drafter.to_hf_dict(), "train_config": self.cfg.as_json()}
            Path(tmp, STATE_NAME).write_text(json.dumps(state, indent=1))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_step{p.step:06d}")
        shutil.rmtree(tmp, ignore_errors=True)
        self.saved_step = p.step


def deepspeed_config(cfg: TrainConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }


def fail_once(marker: Path) -> None:
    """Fault injection (TrainConfig.fail_at_step): raise once per run (the marker file
    remembers it). Ray Train takes a training function's exception as a worker-group
    failure and restarts the group from its latest checkpoint (up to max_failures times).
    An exception, not a process kill: the worker's last report (the latest checkpoint)
    still reaches the controller with the error, so the restart point is always the
    checkpoint just saved; a killed process could take an untaken report with it."""
    if marker.exists():
        return
    marker.touch()
    raise InjectedFailure(f"fault injection: {marker.name}")


def count_nodes() -> int:
    """Distinct Ray nodes in the worker group (node ranks go by IP, which the nodes of a
    one-machine test cluster share; Ray node ids do not)."""
    import ray
    import torch.distributed as dist

    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, ray.get_runtime_context().get_node_id())
    return len(set(ids))


def full_drafter(drafter: DFlashDrafter, dcfg: DrafterConfig, zero_stage: int, build: bool) -> DFlashDrafter | None:
    """A plain fp32 copy of the engine's drafter on the rank that builds it. Collective
    under ZeRO-3 (every rank gathers the partitioned parameters together)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(drafter.parameters()), enabled=zero_stage == 3):
        if not build:
            return None
        copy = DFlashDrafter(dcfg)
        state = {k: p.detach().float().cpu() for k, p in drafter.named_parameters()}
        state |= {k: b.detach().cpu() for k, b in drafter.named_buffers()}  # draft_vocab ids, as they are
        copy.load_state_dict(state, strict=True)
        return copy


def evaluate_tau(target, drafter: DFlashDrafter, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Mean acceptance length over every greedy cycle of every prompt, at the trained block size."""
    from dflash.decoding import SamplingParams, SpeculativeDecoder

    drafter = drafter.to(device=target.device, dtype=target.dtype)
    decoder = SpeculativeDecoder(target, drafter, block_size=drafter.config.block_size)
    requests = decoder.generate(prompts, SamplingParams(max_new_tokens))
    lengths = [n for r in requests for n in r.stats.acceptance_lengths]
    return sum(lengths) / max(1, len(lengths))


class StepStats:
    """Per-position hits/counts, loss and tokens of one optimizer step, summed over workers."""

    def __init__(self, block_size: int):
        self.t0 = time.perf_counter()
        self.correct = torch.zeros(block_size - 1, dtype=torch.float64)
        self.counts = torch.zeros(block_size - 1, dtype=torch.float64)
        self.loss_sum, self.micro, self.tokens, self.padded = 0.0, 0, 0, 0

    def add(self, out, mb) -> None:
        self.correct += out.correct.detach().double().cpu()
        self.counts += out.counts.detach().double().cpu()
        self.loss_sum += float(out.loss.detach())
        self.micro += 1
        self.tokens += mb.tokens
        self.padded += mb.valid.numel()

    def reduce(self, step, epoch, lr, world, device, num_nodes) -> dict:
        import torch.distributed as dist

        flat = torch.cat([self.correct, self.counts,
                          torch.tensor([self.loss_sum, self.micro, self.tokens, self.padded], dtype=torch.float64)])
        flat = flat.to(device)
        dist.all_reduce(flat)
        flat = flat.cpu()
        n = self.correct.numel()
        acc = (flat[:n] / flat[n: 2 * n].clamp(min=1)).tolist()
        loss_sum, micro, tokens, padded = flat[2 * n:].tolist()
        seconds = time.perf_counter() - self.t0
        return {"step": step, "epoch": epoch, "loss": loss_sum / micro, "accuracy": [round(a, 4) for a in acc],
                "implied_tau": implied_tau(acc), "lr": lr, "tokens": int(tokens),
                "tokens_per_s": tokens / seconds, "pad_fraction": 1 - tokens / padded, "step_seconds": seconds,
                "workers": world, "nodes": num_nodes}


class MetricLogger:
    """Rank 0 appends one JSON line per step to metrics.jsonl and prints a short line."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {"time": round(time.time(), 3), **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if "loss" in row:
            tau = f" eval_tau {row['eval_tau']:.3f}" if "eval_tau" in row else ""
            print(f"[train] step {row['step']} loss {row['loss']:.4f} tau~{row['implied_tau']:.3f} "
                  f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s{tau}", flush=True)
