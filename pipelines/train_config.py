"""What a training run is: its config (TrainConfig), the plan the driver makes from it
before any worker starts (TrainPlan, plan_run), and its run directory.

    dflash train --config jobs/configs/train.yaml [key=value ...]

Run directory (output_dir/run_name, shared storage on a cluster):
    checkpoint_step000050/  deepspeed/ (ZeRO shards) + train_state.json, via ray.train.report
    metrics.jsonl           one line per optimizer step (+ eval lines), written by rank 0
    run.json                the model-defining config; a rerun with other values is refused
    drafter/                the final drafter, consolidated from the ZeRO shards (pipelines.export)
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal

from dflash.config import DrafterConfig, check_decode_block_size, default_target_layer_ids
from dflash.training import INITS, tap_rms_scale
from pipelines.train_data import FILE_ORDERS, draft_vocabulary, inspect_training_data

STATE_NAME = "train_state.json"
METRICS_NAME = "metrics.jsonl"
RUN_NAME = "run.json"
DS_DIR, DS_TAG = "deepspeed", "state"
# fields that define the drafter and its data; a resumed run must not change them
MODEL_FIELDS = ("target", "data", "mode", "block_size", "num_draft_layers", "target_layer_ids", "num_taps", "seed",
                "draft_vocab_size", "init_from")


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
    # target: copy the target's last layers (dflash.training.new_drafter)
    init: Literal["random", "zero_output", "target"] = "random"
    # a drafter directory (or "default": the shipped reference drafter) to continue training
    # from, e.g. on new data. Its layers, block size, taps and draft vocabulary are kept, so
    # the config must agree with them; `init` is then unused
    init_from: str | None = None
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
    # fault injection for tests: the last rank raises once, right after this optimizer step
    # (pipelines.train_worker.InjectedFailure); the group restarts from the latest checkpoint
    fail_at_step: int = 0

    def __post_init__(self):
        for name in ("num_workers", "micro_batch_size", "grad_accum", "epochs", "num_anchors", "num_draft_layers",
                     "num_taps", "checkpoint_every", "keep_checkpoints", "bucket_batches", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        check_decode_block_size(self.decode_block_size, self.block_size)
        if not 0 <= self.warmup_ratio < 1 or self.lr <= 0 or self.cpus_per_worker <= 0:
            raise ValueError("need 0 <= warmup_ratio < 1, lr > 0 and cpus_per_worker > 0")
        if self.init_from is not None and self.tap_scaling != "none":
            raise ValueError("init_from continues a drafter trained on raw taps: use tap_scaling=none")
        if self.max_steps < 0 or self.eval_every < 0 or self.max_failures < 0:
            raise ValueError("max_steps, eval_every and max_failures must be >= 0")

    @property
    def offline(self) -> bool:
        return self.mode == "offline"

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir).expanduser().resolve() / self.run_name

    def as_json(self) -> dict:
        """The config as plain JSON values (tuples as lists)."""
        return json.loads(json.dumps(asdict(self), default=str))


@dataclass(frozen=True)
class TrainPlan:
    """What the driver decided, handed to every worker."""

    drafter: DrafterConfig
    steps_per_epoch: int
    total_steps: int
    run_dir: str
    draft_vocab: tuple[int, ...] = ()  # the draftable token ids, when draft_vocab_size > 0
    tap_scale: tuple[float, ...] = ()  # per-feature multipliers of the taps (tap_scaling: rms)
    init_from: str | None = None  # the resolved drafter directory to start from
    file_orders: int = 1  # per-epoch shard file orders the run cycles through (train_data.FILE_ORDERS)


def plan_run(cfg: TrainConfig):
    """Every check that needs no worker: target shape, data metadata, step counts.
    -> (TrainPlan, pipelines.train_data.DataInfo)."""
    from pipelines.distill import inspect_target

    info = inspect_target(cfg.target)
    data = inspect_training_data(cfg.data, offline=cfg.offline, target_id=info.target_id,
                                 weights_hash=info.weights_hash, num_target_layers=info.num_layers,
                                 hidden_size=info.hidden_size, target_layer_ids=cfg.target_layer_ids)
    if cfg.offline:
        layer_ids = data.metadata.target_layer_ids
    else:
        layer_ids = cfg.target_layer_ids or tuple(default_target_layer_ids(info.num_layers, cfg.num_taps))
    drafter = DrafterConfig.for_target(info, cfg.num_draft_layers, cfg.block_size, list(layer_ids),
                                       draft_vocab_size=cfg.draft_vocab_size, decode_block_size=cfg.decode_block_size)
    draft_vocab, init_from = (), None
    if cfg.init_from is not None:
        init_from, draft_vocab = check_init_from(cfg.init_from, info.target_id, drafter)
    elif cfg.draft_vocab_size:
        draft_vocab, coverage = draft_vocabulary(data, info.config.vocab_size, cfg.draft_vocab_size)
        print(f"[train] draft vocabulary: {coverage}", file=sys.stderr)
    rows_per_worker = data.num_rows // cfg.num_workers
    steps_per_epoch = rows_per_worker // cfg.micro_batch_size // cfg.grad_accum
    if steps_per_epoch < 1:
        raise ValueError(f"dataset {cfg.data} has {data.num_rows} rows: too few for num_workers x micro_batch_size "
                         f"x grad_accum = {cfg.num_workers * cfg.micro_batch_size * cfg.grad_accum}")
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    tap_scale = ()
    if cfg.tap_scaling == "rms":
        if not cfg.offline:
            raise ValueError("tap_scaling: rms needs offline data (stored taps); use tap_scaling=none online")
        tap_scale = tap_rms_scale(data.files)
    load_eval_prompts(cfg)  # a bad prompt set fails here, not in a worker
    epochs = -(-total // steps_per_epoch)
    return TrainPlan(drafter, steps_per_epoch, total, str(cfg.run_dir), draft_vocab, tap_scale,
                     None if init_from is None else str(init_from), min(FILE_ORDERS, epochs)), data


def check_init_from(spec: str, target_id: str, planned: DrafterConfig):
    """The drafter to continue from must have the shape this run plans; -> (its directory,
    its draft vocabulary). A mismatch is refused here, before any worker starts."""
    from dflash.checkpoint import load_drafter, read_drafter_config, resolve_drafter

    path = resolve_drafter(spec, target_id)
    if path is None:
        raise ValueError(f"init_from {spec!r} names no drafter")
    have = read_drafter_config(path)
    fields = ("hidden_size", "num_hidden_layers", "block_size", "target_layer_ids", "draft_vocab_size",
              "num_attention_heads", "num_key_value_heads", "intermediate_size")
    value = lambda c, f: tuple(v) if isinstance(v := getattr(c, f), list) else v  # noqa: E731
    diff = {f: (value(have, f), value(planned, f)) for f in fields if value(have, f) != value(planned, f)}
    if diff:
        raise ValueError(f"init_from {path} does not fit this run {diff} (drafter, config): set the config's "
                         f"num_draft_layers, block_size and draft_vocab_size to the drafter's, on data with its taps")
    vocab = load_drafter(path).draft_vocab
    print(f"[train] continuing from drafter {path}", file=sys.stderr)
    return path, () if vocab is None else tuple(int(i) for i in vocab)


def load_eval_prompts(cfg: TrainConfig) -> list[list[dict]]:
    """The first eval_num_prompts held-out conversations (a prompt set name or a .jsonl)."""
    from dflash.prompts import from_jsonl, load_prompt_set

    if not (cfg.eval_every or cfg.eval_at_end):
        return []
    convs = from_jsonl(cfg.eval_prompts) if cfg.eval_prompts.endswith(".jsonl") else load_prompt_set(cfg.eval_prompts)
    if not convs:
        raise ValueError(f"eval_prompts {cfg.eval_prompts}: no prompts")
    return convs[: cfg.eval_num_prompts]


def claim_run_dir(cfg: TrainConfig) -> None:
    """A rerun of the same name resumes; with other model-defining settings it is refused."""
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    mine = {k: v for k, v in cfg.as_json().items() if k in MODEL_FIELDS}
    path = cfg.run_dir / RUN_NAME
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), v) for k, v in mine.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"run {cfg.run_dir} was started with other settings {diff} (old, new): "
                             f"use another run_name or output_dir")
    else:
        path.write_text(json.dumps(mine, indent=1))
