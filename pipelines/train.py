"""Drafter training on Ray Train + DeepSpeed.

    dflash train --config jobs/configs/train.yaml [key=value ...]
    dflash export RUN_DIR OUT_DIR

The driver (`run_train`) checks everything it can before a worker starts: the config, the
target (tokenizer and shape only), and the distilled data's metadata against the drafter
(other target, layer ids, hidden size, format version are refused; an empty dataset is an
error). Then a TorchTrainer runs `train_loop_per_worker` on N workers; each holds the
frozen target (embedding, LM head, and in online mode the tapped forward) and a DeepSpeed
engine around `DrafterObjective`, the drafter plus the dflash/ loss. Ray appears in the
loop only at get_dataset_shard and report(checkpoint).

Run directory (output_dir/run_name, shared storage on a cluster):
    checkpoint_step000050/  deepspeed/ (ZeRO shards) + train_state.json, via ray.train.report
    metrics.jsonl           one line per optimizer step (+ eval lines), written by rank 0
    run.json                the model-defining config; a rerun with other values is refused
    drafter/                the final drafter, consolidated from the ZeRO shards (DESIGN.md 3)
Rerunning the same run name resumes from its latest checkpoint; a worker failure restarts
the worker group from it (max_failures times).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from torch import nn

from dflash.config import DrafterConfig, check_decode_block_size, default_target_layer_ids
from dflash.drafter import DFlashDrafter, OutputHead
from dflash.objective import dflash_loss, implied_tau
from pipelines.train_data import (inspect_training_data, micro_batches, most_frequent_tokens, read_dataset,
                                  response_token_counts, round_to_storage)

STATE_NAME = "train_state.json"
METRICS_NAME = "metrics.jsonl"
RUN_NAME = "run.json"
DS_DIR, DS_TAG = "deepspeed", "state"
# fields that define the drafter and its data; a resumed run must not change them
MODEL_FIELDS = ("target", "data", "mode", "block_size", "num_draft_layers", "target_layer_ids", "num_taps", "seed",
                "draft_vocab_size")


@dataclass(frozen=True)
class TrainConfig:
    """Defaults fit the tiny default target on 2 CPU cores. On GPU use the paper's values
    (jobs/configs/train_gpu.yaml: bf16, 512 anchors, 5 draft layers)."""

    STAGE: ClassVar[str] = "train"

    target: str = "default"
    data: str = "outputs/distill"  # a `dflash distill` output directory
    output_dir: str = "outputs/train"  # storage path: shared (NFS/S3-mounted) on a cluster
    run_name: str = "dflash-train"  # same name again = resume
    mode: Literal["offline", "online"] = "offline"  # stored features, or computed by the target
    # cluster
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: float = 0.5  # leave CPU for the Ray Data readers (2 x 1 CPU on 2 CPUs hangs)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"] = "PACK"
    ray_address: str | None = None  # None: RAY_ADDRESS if set (ray job submit), else a local Ray
    max_failures: int = 2  # worker-group restarts from the latest checkpoint
    # DeepSpeed and optimisation (paper: AdamW 6e-4, cosine, warmup 0.04, clip 1.0, 6 epochs)
    zero_stage: int = 2
    precision: Literal["fp32", "bf16"] = "fp32"
    micro_batch_size: int = 2
    grad_accum: int = 1
    lr: float = 6e-4
    weight_decay: float = 0.0
    epochs: int = 6
    max_steps: int = 0  # > 0: exactly this many optimizer steps, epochs ignored
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    # the objective and the drafter
    num_anchors: int = 32  # paper 512 (GPU); the LM head per scored slot dominates CPU cost
    block_size: int = 16
    decode_block_size: int = 0  # written to the exported config: the block decoding uses (0: block_size)
    num_draft_layers: int = 1
    target_layer_ids: tuple[int, ...] | None = None  # offline: the data's; online: paper spread of num_taps
    num_taps: int = 5
    gamma: float | None = None  # None: by block size (7 for 16)
    # random; zero_output: random with o_proj/down_proj at 0 (each layer starts as the identity);
    # target: copy the target's last layers
    init: Literal["random", "zero_output", "target"] = "random"
    draft_vocab_size: int = 0  # > 0: draft only the K most frequent response tokens of the data
    # rms: train fc on taps divided by each feature's RMS over the data (offline only), folded
    # back into fc at export, so the target's massive activations do not swamp the fusion
    tap_scaling: Literal["none", "rms"] = "none"
    max_seq_len: int = 2048
    bucket_batches: int = 8  # micro-batches per length-sorting buffer
    # checkpoints, metrics, evaluation
    checkpoint_every: int = 50  # optimizer steps; and always at the end
    keep_checkpoints: int = 2
    eval_every: int = 0  # steps between true-tau evaluations (0: only at the end if eval_at_end)
    eval_at_end: bool = False
    eval_prompts: str = "mt-bench"  # a dflash.prompts set, or a .jsonl of held-out prompts
    eval_num_prompts: int = 4
    eval_max_new_tokens: int = 32
    export_dtype: Literal["bf16", "fp32"] = "bf16"
    seed: int = 0
    fail_at_step: int = 0  # fault-injection for tests: the last rank dies once after this step

    def __post_init__(self):
        for name in ("num_workers", "micro_batch_size", "grad_accum", "epochs", "num_anchors", "num_draft_layers",
                     "num_taps", "checkpoint_every", "keep_checkpoints", "bucket_batches", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        check_decode_block_size(self.decode_block_size, self.block_size)
        if not 0 <= self.warmup_ratio < 1 or self.lr <= 0 or self.cpus_per_worker <= 0:
            raise ValueError("need 0 <= warmup_ratio < 1, lr > 0 and cpus_per_worker > 0")
        if self.max_steps < 0 or self.eval_every < 0 or self.max_failures < 0:
            raise ValueError("max_steps, eval_every and max_failures must be >= 0")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() / self.run_name


@dataclass(frozen=True)
class TrainPlan:
    """What the driver decided, handed to every worker."""

    drafter_config: dict  # DrafterConfig.to_hf_dict()
    steps_per_epoch: int
    total_steps: int
    run_dir: str
    draft_vocab: tuple[int, ...] = ()  # the draftable token ids, when draft_vocab_size > 0
    tap_scale: tuple[float, ...] = ()  # per-feature multipliers of the taps (tap_scaling: rms)


# --- the model DeepSpeed trains ------------------------------------------------------------

class DrafterObjective(nn.Module):
    """The drafter plus its loss, so DeepSpeed's forward returns the loss (and ZeRO-3's
    gather hooks see every parameter use). The frozen target is held outside the module
    tree: DeepSpeed neither shards, casts nor optimises it."""

    def __init__(self, drafter: DFlashDrafter, target, cfg: TrainConfig, tap_scale: tuple[float, ...] = ()):
        super().__init__()
        self.drafter = drafter
        self._target = (target,)  # a tuple hides it from nn.Module registration
        self.num_anchors, self.gamma = cfg.num_anchors, cfg.gamma
        # a buffer, so it travels in every checkpoint and export can fold it into fc
        self.register_buffer("tap_scale", torch.tensor(tap_scale, dtype=torch.float32) if tap_scale else None)
        self._head = None  # OutputHead, built on first use (the draft vocabulary is fixed by then)

    def forward(self, input_ids, loss_mask, taps, valid, generator):
        target = self._target[0]
        if self.tap_scale is not None:
            taps = taps.float() * self.tap_scale
        if self._head is None:
            self._head = OutputHead(target.model.lm_head.weight, self.drafter.draft_vocab)
        head = self._head
        return dflash_loss(self.drafter, target.embed, head.logits, input_ids, loss_mask, taps, valid,
                           num_anchors=self.num_anchors, gamma=self.gamma, generator=generator,
                           label_index=head.index)


@torch.no_grad()
def fold_tap_scale(drafter: DFlashDrafter, tap_scale: torch.Tensor | None) -> DFlashDrafter:
    """fc(taps * s) == fc'(taps) with fc' = fc * s per input column: the exported drafter
    reads raw taps, in the public layout."""
    if tap_scale is not None:
        drafter.fc.weight.mul_(tap_scale.to(drafter.fc.weight)[None, :])
    return drafter


def tap_rms_scale(files, max_rows: int = 64) -> tuple[float, ...]:
    """1 / RMS of each tap feature over the first `max_rows` samples of the data (their
    position 0, the attention sink with RMS ~1000, left out)."""
    import numpy as np
    import pyarrow.parquet as pq

    from dflash.data import hidden_arrays

    sq, tokens, rows = 0.0, 0, 0
    for f in files:
        for h in hidden_arrays(pq.read_table(f, columns=["hidden"]))[: max_rows - rows]:
            x = h[1:].astype(np.float64)
            sq, tokens, rows = sq + (x * x).sum(0), tokens + len(x), rows + 1
        if rows >= max_rows:
            break
    rms = np.sqrt(sq / max(1, tokens))
    return tuple(float(v) for v in 1.0 / np.maximum(rms, 1e-3))


@torch.no_grad()
def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Copy the target's last L decoder layers (attention, MLP, norms) and final norm into
    the drafter; fc starts as a selector of the deepest tap. q_norm/k_norm stay identity
    when the target has none (Llama)."""
    layers = target.model.model.layers
    L, D = len(drafter.layers), drafter.config.hidden_size
    for mine, theirs in zip(drafter.layers, layers[len(layers) - L:]):
        own = mine.state_dict()
        own.update({k: v for k, v in theirs.state_dict().items() if k in own and own[k].shape == v.shape})
        mine.load_state_dict(own)
    drafter.norm.weight.copy_(target.model.model.norm.weight)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, -D:] = torch.eye(D)


def warmup_cosine(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


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


# --- the per-worker loop -----------------------------------------------------------------

def train_loop_per_worker(loop_config: dict) -> None:
    import deepspeed
    import ray.train
    import torch.distributed as dist

    from dflash.target import load_target

    cfg: TrainConfig = loop_config["cfg"]
    plan: TrainPlan = loop_config["plan"]
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = f"cuda:{ctx.get_local_rank()}" if cfg.use_gpu else "cpu"
    target = load_target(cfg.target, device=device, dtype=cfg.precision)
    dcfg = DrafterConfig.from_hf_dict(plan.drafter_config)
    torch.manual_seed(cfg.seed)
    drafter = DFlashDrafter(dcfg)
    if cfg.init == "zero_output":
        drafter.reset_parameters(zero_output=True)
    elif cfg.init == "target":
        init_from_target(drafter, target)
    if plan.draft_vocab:
        drafter.set_draft_vocab(plan.draft_vocab)
    model = DrafterObjective(drafter.to(device), target, cfg, plan.tap_scale)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(plan.total_steps, cfg.warmup_ratio))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg), dist_init_required=False)
    step, epoch, micro_done, restored = 0, 0, 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            engine.load_checkpoint(os.path.join(d, DS_DIR), tag=DS_TAG)
            state = json.loads(Path(d, STATE_NAME).read_text())
        step, epoch, micro_done, restored = state["step"], state["epoch"], state["micro_in_epoch"], state["step"]
    node_count = _count_nodes()
    prompts = [target.chat_ids(c) for c in load_eval_prompts(cfg)] if rank == 0 else None
    log = MetricLogger(Path(plan.run_dir) / METRICS_NAME, enabled=rank == 0)
    if restored is not None:
        log.write({"event": "resumed", "step": step})

    def save(step, epoch, micro_in_epoch, metrics):
        tmp = tempfile.mkdtemp(prefix="dflash-ckpt-")
        engine.save_checkpoint(os.path.join(tmp, DS_DIR), tag=DS_TAG)
        if rank == 0:
            state = {"step": step, "epoch": epoch, "micro_in_epoch": micro_in_epoch, "total_steps": plan.total_steps,
                     "drafter_config": plan.drafter_config, "train_config": _jsonable(cfg)}
            Path(tmp, STATE_NAME).write_text(json.dumps(state, indent=1))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_step{step:06d}")
        shutil.rmtree(tmp, ignore_errors=True)

    shard = ray.train.get_dataset_shard("train")
    offline = cfg.mode == "offline"
    micro_per_epoch = plan.steps_per_epoch * cfg.grad_accum
    metrics, last_saved = {}, restored
    engine.train()
    while step < plan.total_steps:
        acc = StepStats(dcfg.block_size)
        batches = micro_batches(shard, micro_batch_size=cfg.micro_batch_size, bucket_batches=cfg.bucket_batches,
                                max_seq_len=cfg.max_seq_len, offline=offline, seed=cfg.seed * 1000 + epoch)
        for i, mb in enumerate(batches):
            if i >= micro_per_epoch or step >= plan.total_steps:
                break
            if i < micro_done:  # already trained on before the restart
                continue
            if i % cfg.grad_accum == 0:
                lr = scheduler.get_last_lr()[0]  # the rate this optimizer step uses
            mb_taps = mb.taps if offline else round_to_storage(online_taps(target, mb, dcfg.target_layer_ids))
            gen = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + epoch) * 1_000_003 + i) * 4099 + rank)
            out = engine(mb.input_ids.to(device), mb.loss_mask.to(device), mb_taps.to(device, target.dtype),
                         mb.valid.to(device), gen)
            engine.backward(out.loss)
            engine.step()
            acc.add(out, mb)
            if (i + 1) % cfg.grad_accum:
                continue
            step += 1
            metrics = acc.reduce(step, epoch, lr, world, device, node_count)
            acc = StepStats(dcfg.block_size)
            last_step = step == plan.total_steps
            if (cfg.eval_every and step % cfg.eval_every == 0) or (last_step and cfg.eval_at_end):
                copy = full_drafter(engine.module.drafter, dcfg, cfg.zero_stage, build=rank == 0)
                if rank == 0:
                    fold_tap_scale(copy, engine.module.tap_scale)
                    metrics["eval_tau"] = evaluate_tau(target, copy, prompts, cfg.eval_max_new_tokens)
                dist.barrier()
            log.write(metrics)
            if step % cfg.checkpoint_every == 0 or last_step:
                end_of_epoch = i + 1 == micro_per_epoch
                save(step, epoch + end_of_epoch, 0 if end_of_epoch else i + 1, metrics)
                last_saved = step
            if cfg.fail_at_step and step == cfg.fail_at_step and rank == world - 1:
                die_once(Path(plan.run_dir) / f".failed_at_{step}")
        micro_done = 0
        epoch += 1
    if last_saved != step:  # e.g. resumed at the end, or a run that had no step left
        save(step, epoch, 0, metrics or {"step": step})


def die_once(marker: Path) -> None:
    """Fault injection for tests (fail_at_step): a hard worker death, as a crash or a lost
    node would be, once per run (the marker file remembers it).

    Ray Train registers a reported checkpoint only when its controller polls the workers'
    reports (every couple of seconds). A worker that died sooner than that would take the
    last checkpoint with it, and the restart would begin from the one before (a race that a
    loaded machine loses). So the dying worker first waits until the controller has taken
    its reports, then gives the reply a moment to leave the process."""
    if marker.exists():
        return
    marker.touch()
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        get_train_context().get_result_queue().join()  # every report taken by the controller
        time.sleep(1.0)
    except Exception:  # another Ray Train version: outwait its poll instead
        time.sleep(10.0)
    os._exit(1)


# --- evaluation: the true tau, by speculative decoding ---------------------------------------

def load_eval_prompts(cfg: TrainConfig) -> list[list[dict]]:
    """The first eval_num_prompts held-out conversations (a prompt set name or a .jsonl)."""
    from dflash.prompts import from_jsonl, load_prompt_set

    if not (cfg.eval_every or cfg.eval_at_end):
        return []
    convs = from_jsonl(cfg.eval_prompts) if cfg.eval_prompts.endswith(".jsonl") else load_prompt_set(cfg.eval_prompts)
    if not convs:
        raise ValueError(f"eval_prompts {cfg.eval_prompts}: no prompts")
    return convs[: cfg.eval_num_prompts]


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


def online_taps(target, mb, layer_ids) -> torch.Tensor:
    """The frozen target's tapped features for a right-padded micro-batch (b, T, n_taps*D)."""
    from dflash.masks import causal_attention_mask

    dev = target.device
    ids, valid = mb.input_ids.to(dev), mb.valid.to(dev)
    positions = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    return target.tapped_features(ids, positions, causal_attention_mask(valid), tuple(layer_ids))


def _count_nodes() -> int:
    """Distinct Ray nodes in the worker group (node ranks go by IP, which the nodes of a
    one-machine test cluster share; Ray node ids do not)."""
    import ray
    import torch.distributed as dist

    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, ray.get_runtime_context().get_node_id())
    return len(set(ids))


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


def _jsonable(cfg: TrainConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


# --- the driver ------------------------------------------------------------------------------

def plan_run(cfg: TrainConfig) -> tuple[TrainPlan, object]:
    """Every check that needs no worker: target shape, data metadata, step counts."""
    from pipelines.distill import inspect_target

    info = inspect_target(cfg.target)
    hf_config = info.config
    offline = cfg.mode == "offline"
    data = inspect_training_data(cfg.data, offline=offline, target_id=info.target_id,
                                 weights_hash=info.weights_hash, num_target_layers=info.num_layers,
                                 hidden_size=info.hidden_size, target_layer_ids=cfg.target_layer_ids)
    if offline:
        layer_ids = data.metadata.target_layer_ids
    else:
        layer_ids = cfg.target_layer_ids or tuple(default_target_layer_ids(info.num_layers, cfg.num_taps))
    dcfg = DrafterConfig.for_target(info, cfg.num_draft_layers, cfg.block_size, list(layer_ids),
                                    draft_vocab_size=cfg.draft_vocab_size,
                                    decode_block_size=cfg.decode_block_size)
    draft_vocab = ()
    if cfg.draft_vocab_size:
        counts = response_token_counts(data, hf_config.vocab_size)
        draft_vocab = most_frequent_tokens(counts, cfg.draft_vocab_size)
        covered = counts[list(draft_vocab)].sum() / max(1, counts.sum())
        print(f"[train] draft vocabulary: the {cfg.draft_vocab_size} most frequent response tokens cover "
              f"{covered:.1%} of the data's {int(counts.sum())} response tokens", file=sys.stderr)
    rows_per_worker = data.num_rows // cfg.num_workers
    steps_per_epoch = rows_per_worker // cfg.micro_batch_size // cfg.grad_accum
    if steps_per_epoch < 1:
        raise ValueError(f"dataset {cfg.data} has {data.num_rows} rows: too few for num_workers x micro_batch_size "
                         f"x grad_accum = {cfg.num_workers * cfg.micro_batch_size * cfg.grad_accum}")
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    tap_scale = ()
    if cfg.tap_scaling == "rms":
        if not offline:
            raise ValueError("tap_scaling: rms needs offline data (stored taps); use tap_scaling=none online")
        tap_scale = tap_rms_scale(data.files)
    load_eval_prompts(cfg)  # a bad prompt set fails here, not in a worker
    plan = TrainPlan(dcfg.to_hf_dict(), steps_per_epoch, total, str(cfg.run_dir), draft_vocab, tap_scale)
    return plan, data


def claim_run_dir(cfg: TrainConfig) -> None:
    """A rerun of the same name resumes; with other model-defining settings it is refused."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    mine = {k: v for k, v in _jsonable(cfg).items() if k in MODEL_FIELDS}
    path = cfg.run_dir / RUN_NAME
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in mine.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"run {cfg.run_dir} was started with other settings {diff} (old, new): "
                             f"use another run_name or output_dir")
    else:
        path.write_text(json.dumps(mine, indent=1))


def _init_ray(cfg: TrainConfig):
    import ray

    if not ray.is_initialized():
        address = cfg.ray_address or os.environ.get("RAY_ADDRESS") or "local"
        kwargs = {"include_dashboard": False} if address == "local" else {}
        ray.init(address=address, **kwargs)
    return ray


def check_cpu_budget(cfg: TrainConfig, cluster_cpus: float) -> None:
    """Ray Train hands Ray Data only the CPUs its workers leave over. When the workers fit
    but leave less than one CPU, the parquet read never gets scheduled and the run hangs
    silently (e.g. 2 workers x 1 CPU on a 2-CPU machine), so refuse that up front. A
    cluster too small for the workers is left alone: Ray Train waits for autoscaling."""
    needed = cfg.num_workers * cfg.cpus_per_worker
    if needed <= cluster_cpus < needed + 1:
        raise ValueError(
            f"{cfg.num_workers} workers x {cfg.cpus_per_worker:g} CPU leave {cluster_cpus - needed:g} of the "
            f"cluster's {cluster_cpus:g} CPUs for Ray Data's parquet reads, which need 1; lower "
            f"cpus_per_worker (e.g. to {max(0.1, (cluster_cpus - 1) / cfg.num_workers):.2g}) or num_workers")


def ordered_ingest():
    """Rows reach the workers in file order, so the same data and seed give the same
    micro-batches (and losses) run after run and in both modes; shuffling is local and
    seeded (pipelines.train_data)."""
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(execution_options=options)


def run_train(cfg: TrainConfig) -> dict:
    """Train (or resume) cfg.run_name; export the final drafter; return a summary."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t0 = time.perf_counter()
    plan, data = plan_run(cfg)
    ray = _init_ray(cfg)
    check_cpu_budget(cfg, ray.cluster_resources().get("CPU", 0.0))
    claim_run_dir(cfg)
    env = {"OMP_NUM_THREADS": str(max(1, int(cfg.cpus_per_worker))), "TOKENIZERS_PARALLELISM": "false"}
    if not cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    resources = {"CPU": cfg.cpus_per_worker} | ({"GPU": 1} if cfg.use_gpu else {})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg, "plan": plan},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=resources, placement_strategy=cfg.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        datasets={"train": read_dataset(data, cfg.mode == "offline")},
        dataset_config=ordered_ingest(),
        run_config=RunConfig(name=cfg.run_name, storage_path=str(cfg.run_dir.parent),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                             worker_runtime_env={"env_vars": env}),
    )
    trainer.fit()
    drafter_dir = export_run(cfg.run_dir, cfg.run_dir / "drafter", dtype=cfg.export_dtype, overwrite=True)
    summary = summarize(cfg, plan, drafter_dir, time.perf_counter() - t0)
    print(json.dumps({k: summary[k] for k in ("steps", "first_loss", "final_loss", "final_implied_tau")}),
          file=sys.stderr)
    return summary


def summarize(cfg: TrainConfig, plan: TrainPlan, drafter_dir: Path, seconds: float) -> dict:
    rows = [json.loads(l) for l in (cfg.run_dir / METRICS_NAME).read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in steps if "eval_tau" in r]
    last = steps[-1] if steps else {}
    return {
        "run_dir": str(cfg.run_dir), "drafter_dir": str(drafter_dir), "steps": last.get("step", 0),
        "total_steps": plan.total_steps, "steps_per_epoch": plan.steps_per_epoch,
        "first_loss": steps[0]["loss"] if steps else None, "final_loss": last.get("loss"),
        "final_accuracy": last.get("accuracy"), "final_implied_tau": last.get("implied_tau"),
        "eval_tau": [(r["step"], r["eval_tau"]) for r in evals],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps) if steps else 0.0,
        "resumes": sum(1 for r in rows if r.get("event") == "resumed"),  # restarts after failures + reruns
        "workers": last.get("workers"), "nodes": last.get("nodes"), "seconds": round(seconds, 1),
    }


# --- export ----------------------------------------------------------------------------------

def latest_checkpoint(run_dir: str | Path) -> Path:
    found = []
    for d in Path(run_dir).glob("checkpoint_*"):
        state = d / STATE_NAME
        if state.is_file() and (d / DS_DIR).is_dir():
            found.append((json.loads(state.read_text())["step"], d))
    if not found:
        raise FileNotFoundError(f"no training checkpoint in {run_dir}")
    return max(found)[1]


def export_run(run_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", overwrite: bool = False) -> Path:
    """Consolidate the latest checkpoint's ZeRO shards into one drafter directory in the
    public DFlash layout (config.json + model.safetensors)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dflash.checkpoint import save_drafter

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / STATE_NAME).read_text())
    full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / DS_DIR), tag=DS_TAG)
    prefix = "drafter."
    weights = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    drafter = DFlashDrafter(DrafterConfig.from_hf_dict(state["drafter_config"]))
    drafter.load_state_dict(weights, strict=True)
    fold_tap_scale(drafter, full.get("tap_scale"))
    if out.exists():
        shutil.rmtree(out)
    meta = {"step": state["step"], "checkpoint": str(ckpt), "train_config": state["train_config"]}
    return save_drafter(drafter, out, dtype=dtype, extra_files={"training.json": json.dumps(meta, indent=1)})
