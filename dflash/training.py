"""The training pieces that need no cluster: torch only, shared by the Ray Train worker
(pipelines/train_worker.py), the one-device experiments in benchmarks/ and the tests.

    rows      table_rows / read_rows: a distilled shard's token (and tap) columns as arrays;
              label_rows: teacher-forced data's target_ids column
    batches   right_pad, collate -> MicroBatch: right-padded tensors of a few rows
    features  target_features: the frozen target's taps of a padded batch;
              round_to_storage: the one rule that turns features into stored numbers
    drafter   new_drafter (random / zero_output / target init, draft vocabulary),
              init_from_target, token_counts + most_frequent_tokens (the draft vocabulary)
    objective DrafterObjective (drafter + loss, what DeepSpeed trains), tap_rms_scale and
              fold_tap_scale (train on unit-RMS taps, export raw-tap weights), warmup_cosine
    held out  fixed_anchors + heldout_metrics: teacher-forced loss, per-position accuracy
              and the tau they imply, on fixed rows and anchors

Online and offline training read the same numbers: offline features were stored by
`round_to_storage` (dflash.regenerate.tapped_hidden), online ones pass through it in the
trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dflash.config import DrafterConfig
from dflash.data import FEATURE_DTYPE, hidden_arrays
from dflash.drafter import DFlashDrafter, OutputHead
from dflash.masks import causal_attention_mask, sample_anchors
from dflash.objective import dflash_loss, implied_tau

STORAGE_DTYPE = getattr(torch, FEATURE_DTYPE)
INITS = ("random", "zero_output", "target")


# --- rows and padded batches -------------------------------------------------------------------

def table_rows(table, max_seq_len: int | None = None, with_hidden: bool = False):
    """A distilled pyarrow table -> (ids, masks, hidden) lists of per-row numpy arrays, each
    cut to max_seq_len tokens: ids int32 (n,), masks uint8 (n,), hidden float16 (n, n_taps*D)
    or None when with_hidden is False (the column is then never touched)."""
    cut = slice(None, max_seq_len)
    ids = [np.asarray(x, dtype=np.int32)[cut] for x in table.column("input_ids").to_numpy(zero_copy_only=False)]
    masks = [np.asarray(x, dtype=np.uint8)[cut] for x in table.column("loss_mask").to_numpy(zero_copy_only=False)]
    hidden = [h[cut] for h in hidden_arrays(table)] if with_hidden else None
    return ids, masks, hidden


def label_rows(table, max_seq_len: int | None = None) -> list[np.ndarray] | None:
    """The target_ids column of teacher-forced data (dflash.data) as per-row int32 arrays cut
    to max_seq_len, or None for regenerated data (no such column: the tokens are the labels)."""
    if "target_ids" not in table.column_names:
        return None
    cut = slice(None, max_seq_len)
    return [np.asarray(x, dtype=np.int32)[cut] for x in table.column("target_ids").to_numpy(zero_copy_only=False)]


def read_rows(files, max_seq_len: int | None = None, with_hidden: bool = False, max_rows: int | None = None):
    """table_rows over whole shard files, in file order: the first max_rows rows (all if None)."""
    import pyarrow.parquet as pq

    columns = ["input_ids", "loss_mask"] + (["hidden"] if with_hidden else [])
    ids, masks, hidden = [], [], []
    for f in files:
        i, m, h = table_rows(pq.read_table(f, columns=columns), max_seq_len, with_hidden)
        ids, masks, hidden = ids + i, masks + m, hidden + (h or [])
        if max_rows and len(ids) >= max_rows:
            break
    ids, masks, hidden = ids[:max_rows], masks[:max_rows], hidden[:max_rows]
    return ids, masks, hidden if with_hidden else None


@dataclass
class MicroBatch:
    """Right-padded tensors of one micro-batch (b rows, T = longest row)."""

    input_ids: torch.Tensor  # (b, T) long
    loss_mask: torch.Tensor  # (b, T) bool
    valid: torch.Tensor  # (b, T) bool, False on padding
    taps: torch.Tensor | None  # (b, T, n_taps*D) stored (float16) features, when the rows carry them
    target_ids: torch.Tensor | None = None  # (b, T) long: teacher-forced data's labels (dflash.data)

    @property
    def tokens(self) -> int:
        return int(self.valid.sum())


def right_pad(rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths -> ids (b, T) long, zero-padded on the right, and
    valid (b, T) bool. Example: [[5, 6, 7], [8]] -> ids [[5, 6, 7], [8, 0, 0]],
    valid [[1, 1, 1], [1, 0, 0]]."""
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    valid = torch.zeros(len(rows), t, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.int64))
        valid[i, : len(r)] = True
    return ids, valid


def collate(ids: list[np.ndarray], masks: list[np.ndarray], hidden: list[np.ndarray] | None,
            labels: list[np.ndarray] | None = None) -> MicroBatch:
    """Rows from table_rows -> one MicroBatch (taps only when hidden is given, target_ids
    only when labels (label_rows) are)."""
    input_ids, valid = right_pad(ids)
    loss_mask = torch.zeros_like(valid)
    taps = None
    if hidden is not None:
        taps = torch.zeros(*valid.shape, hidden[0].shape[1], dtype=STORAGE_DTYPE)
    for i, m in enumerate(masks):
        loss_mask[i, : len(m)] = torch.from_numpy(np.asarray(m).astype(bool))
        if taps is not None:
            taps[i, : len(m)] = torch.from_numpy(np.ascontiguousarray(hidden[i]))
    return MicroBatch(input_ids, loss_mask, valid, taps, right_pad(labels)[0] if labels is not None else None)


# --- target features ---------------------------------------------------------------------------

@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, valid: torch.Tensor, layer_ids) -> torch.Tensor:
    """The frozen target's tapped features of a right-padded batch: input_ids, valid (b, T)
    -> (b, T, n_taps*D) in the target's dtype, on its device (rows attend causally to their
    own valid tokens; padding positions hold whatever the forward gives them)."""
    dev = target.device
    ids, valid = input_ids.to(dev), valid.to(dev)
    positions = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    return target.tapped_features(ids, positions, causal_attention_mask(valid), tuple(layer_ids))


def round_to_storage(taps: torch.Tensor) -> torch.Tensor:
    """Features as they are stored (STORAGE_DTYPE, float16): clamped to its finite range,
    then rounded. Offline features were written through this rule and online ones pass
    through it, so both modes train on the same numbers. SmolLM2's position-0 activations
    reach ~2.5e4, below the 6.55e4 limit; the clamp keeps other targets' from turning inf."""
    limit = torch.finfo(STORAGE_DTYPE).max
    return taps.float().clamp(-limit, limit).to(STORAGE_DTYPE)


# --- the drafter to train ----------------------------------------------------------------------

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


def new_drafter(config: DrafterConfig, target, init: str = "random", draft_vocab=()) -> DFlashDrafter:
    """A drafter to train, on the CPU: `init` is random, zero_output (random with o_proj and
    down_proj at 0, so each layer starts as the identity) or target (init_from_target);
    draft_vocab, the draftable target ids when config.draft_vocab_size > 0. Draws from
    torch's global generator: seed it first."""
    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    drafter = DFlashDrafter(config)
    if init == "zero_output":
        drafter.reset_parameters(zero_output=True)
    elif init == "target":
        init_from_target(drafter, target)
    if len(draft_vocab):
        drafter.set_draft_vocab(draft_vocab)
    return drafter


def token_counts(ids, masks, vocab_size: int) -> np.ndarray:
    """(V,) how often each token id occurs where the mask is set (the response tokens):
    ids and masks are matching per-row arrays."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i, m in zip(ids, masks):
        counts += np.bincount(np.asarray(i)[np.asarray(m).astype(bool)], minlength=vocab_size)[:vocab_size]
    return counts


def most_frequent_tokens(counts: np.ndarray, k: int) -> tuple[int, ...]:
    """The k most frequent ids (ties: the lower id first), sorted by id: the draft vocabulary.
    Example: counts [0, 5, 2, 5], k=2 -> (1, 3)."""
    order = np.argsort(-counts, kind="stable")[:k]
    return tuple(sorted(int(i) for i in order))


# --- the objective DeepSpeed trains ------------------------------------------------------------

class DrafterObjective(nn.Module):
    """The drafter plus its loss, so DeepSpeed's forward returns the loss (and ZeRO-3's
    gather hooks see every parameter use). The frozen target is held outside the module
    tree: DeepSpeed neither shards, casts nor optimises it. tap_scale: per-feature
    multipliers of the taps (tap_rms_scale), () for raw taps."""

    def __init__(self, drafter: DFlashDrafter, target, num_anchors: int, gamma: float | None = None,
                 tap_scale: tuple[float, ...] = ()):
        super().__init__()
        self.drafter = drafter
        self._target = (target,)  # a tuple hides it from nn.Module registration
        self.num_anchors, self.gamma = num_anchors, gamma
        # a buffer, so it travels in every checkpoint and export can fold it into fc
        self.register_buffer("tap_scale", torch.tensor(tap_scale, dtype=torch.float32) if tap_scale else None)
        self._head = None  # OutputHead, built on first use (the draft vocabulary is fixed by then)

    def forward(self, input_ids, loss_mask, taps, valid, generator, target_ids=None):
        """input_ids, loss_mask, valid (b, T); taps (b, T, n_taps*D); target_ids (b, T) for
        teacher-forced data -> dflash.objective.LossOutput."""
        target = self._target[0]
        if self.tap_scale is not None:
            taps = taps.float() * self.tap_scale
        if self._head is None:
            self._head = OutputHead(target.model.lm_head.weight, self.drafter.draft_vocab)
        head = self._head
        return dflash_loss(self.drafter, target.embed, head.logits, input_ids, loss_mask, taps, valid,
                           num_anchors=self.num_anchors, gamma=self.gamma, generator=generator,
                           label_index=head.index, target_ids=target_ids)


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
    _, _, hidden = read_rows(files, with_hidden=True, max_rows=max_rows)
    sq, tokens = 0.0, 0
    for h in hidden:
        x = h[1:].astype(np.float64)
        sq, tokens = sq + (x * x).sum(0), tokens + len(x)
    rms = np.sqrt(sq / max(1, tokens))
    return tuple(float(v) for v in 1.0 / np.maximum(rms, 1e-3))


def warmup_cosine(total_steps: int, warmup_ratio: float):
    """LambdaLR factor: linear warm-up over round(total * ratio) steps (at least 1 when the
    ratio is > 0), then cosine to 0 at total_steps. Example: total 100, ratio 0.04 ->
    0.25, 0.5, 0.75, 1.0 for steps 0-3, 0.5 at step 52, 0 at step 100."""
    warmup = max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


# --- held-out evaluation -----------------------------------------------------------------------

def fixed_anchors(batch: MicroBatch, num_anchors: int = 64, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors drawn once among a held-out batch's response tokens, so every evaluation of
    every drafter scores the same blocks: (anchors (b, A), valid (b, A))."""
    return sample_anchors(batch.loss_mask & batch.valid, num_anchors, torch.Generator().manual_seed(seed))


@torch.no_grad()
def heldout_metrics(drafter: DFlashDrafter, target, batch: MicroBatch, taps: torch.Tensor, anchors,
                    autocast: torch.dtype | None = None) -> dict:
    """Teacher-forced loss (over the draft vocabulary), top-1 accuracy per block position
    (over all labels) and the tau they imply, at fixed anchors, on the drafter's device.
    taps (b, T, F) as the drafter reads them; autocast: run the drafter under torch.autocast."""
    dev = next(drafter.parameters()).device
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    was_training = drafter.training
    drafter.eval()
    with torch.autocast(dev.type, dtype=autocast, enabled=autocast is not None):
        out = dflash_loss(drafter, target.embed, head.logits, batch.input_ids.to(dev), batch.loss_mask.to(dev),
                          taps.to(dev), batch.valid.to(dev), anchors=tuple(a.to(dev) for a in anchors),
                          label_index=head.index,
                          target_ids=batch.target_ids.to(dev) if batch.target_ids is not None else None)
    drafter.train(was_training)
    acc = out.accuracy.tolist()
    return {"eval_loss": round(float(out.loss), 4), "eval_accuracy": [round(a, 4) for a in acc],
            "eval_implied_tau": round(implied_tau(acc), 4)}
