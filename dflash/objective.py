"""The DFlash training objective: many random blocks per sequence, one drafter pass.

For a sequence with target features, sample anchors among response tokens, lay out one
block [x_anchor, MASK x (B-1)] per anchor, run the drafter once over all blocks with the
training mask (dflash.masks.training_attention_mask), and score slot k of each block
against the token at anchor+k with weight exp(-(k-1)/gamma). The loss is normalised by the
weights of the scored slots. The same `DFlashDrafter.forward` runs at inference; the
parity test (tests/test_objective.py) holds the two together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash.drafter import DFlashDrafter
from dflash.masks import (block_input_ids, block_labels, block_positions, position_weights, sample_anchors,
                          training_attention_mask)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # (B-1,) correct top-1 predictions per block slot k = 1..B-1
    counts: torch.Tensor  # (B-1,) scored predictions per slot
    num_predictions: int

    @property
    def accuracy(self) -> torch.Tensor:
        """Per-position accuracy (B-1,); NaN-free (0 where nothing was scored)."""
        return self.correct / self.counts.clamp(min=1)


def implied_tau(per_position_acc: torch.Tensor | list[float]) -> float:
    """Acceptance length implied by per-position accuracies, treating slot k as accepted
    only if slots 1..k all were: tau = 1 + sum_k prod_{j<=k} acc_j. An estimate (the
    accuracies are not conditional), handy for watching training."""
    acc = torch.as_tensor(per_position_acc, dtype=torch.float64)
    return float(1.0 + acc.cumprod(0).sum())


def drafter_training_hidden(
    drafter: DFlashDrafter,
    embed,
    input_ids: torch.Tensor,
    taps: torch.Tensor,
    context_valid: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """All blocks of a batch in one drafter pass.

    input_ids (b, T); taps (b, T, n_taps*D) target features; context_valid (b, T) bool
    (False on padding); anchors (b, A) -> hidden (b, A, B, D).
    """
    cfg = drafter.config
    b, t = input_ids.shape
    B = cfg.block_size
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    context = drafter.context_kv(taps.masked_fill(~context_valid[..., None], 0), positions)
    ids = block_input_ids(input_ids, anchors, B, cfg.mask_token_id)
    mask = training_attention_mask(anchors, context_valid, B)
    with torch.no_grad():  # the target's frozen embedding (and an imported drafter's mask embedding)
        emb = drafter.embed_block(embed, ids)
    hidden = drafter(emb, block_positions(anchors, B), context, mask)
    return hidden.view(b, anchors.shape[1], B, -1)


def soft_cross_entropy(logits, soft_labels, anchor_pos, sel, label_index=None) -> torch.Tensor:
    """Per scored slot, CE of the draft logits (N, K) against the target's top-k
    distribution at the slot's label position anchor + k; entries outside the draft
    vocabulary are dropped and the rest renormalised (a slot with none scores 0)."""
    ids, probs = soft_labels
    b_idx, a_idx, k_idx = sel
    pos = anchor_pos[b_idx, a_idx] + k_idx + 1  # label position of each scored slot
    cols = ids[b_idx, pos]  # (N, k)
    if label_index is not None:
        cols = label_index(cols)
    q = probs[b_idx, pos].float() * (cols >= 0)
    q = q / q.sum(-1, keepdim=True).clamp(min=1e-8)
    logp = torch.log_softmax(logits, -1).gather(1, cols.clamp(min=0))
    return -(q * logp).sum(-1)


def dflash_loss(
    drafter: DFlashDrafter,
    embed,
    lm_head,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    taps: torch.Tensor,
    context_valid: torch.Tensor | None = None,
    num_anchors: int = 512,
    gamma: float | None = None,
    generator: torch.Generator | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    label_index=None,
    soft_labels: tuple[torch.Tensor, torch.Tensor] | None = None,
    soft_weight: float = 1.0,
    target_ids: torch.Tensor | None = None,
) -> LossOutput:
    """Weighted same-position cross-entropy over random blocks.

    input_ids, loss_mask (b, T); taps (b, T, n_taps*D); context_valid (b, T) (default: all).
    `embed` and `lm_head` are the target's frozen modules. `anchors` = (anchors, valid)
    overrides sampling (tests, evaluation). With a restricted draft vocabulary, `lm_head`
    scores only the K draftable tokens and `label_index` maps target ids to those K columns
    (-1 outside: such labels carry no loss, nothing could learn them, but they count as
    misses in the accuracies); see dflash.drafter.OutputHead.

    soft_labels = (ids, probs), both (b, T, k): the target's top-k distribution for the
    token AT each position (from its logits one position earlier). With them the loss is
    (1 - soft_weight) * hard CE + soft_weight * CE against that distribution, renormalised
    over its draftable entries (logit distillation; accuracies still count hard labels).

    target_ids (b, T): teacher-forced data's labels, the target's greedy token at each
    position; a slot is scored only while the block follows the target's own path
    (dflash.masks.block_labels).
    """
    cfg = drafter.config
    B = cfg.block_size
    if context_valid is None:
        context_valid = torch.ones_like(input_ids, dtype=torch.bool)
    loss_mask = loss_mask.bool() & context_valid
    if anchors is None:
        anchors = sample_anchors(loss_mask, num_anchors, generator)
    anchor_pos, anchor_valid = anchors
    hidden = drafter_training_hidden(drafter, embed, input_ids, taps, context_valid, anchor_pos)
    labels, label_valid = block_labels(input_ids, loss_mask, anchor_pos, anchor_valid, B, target_ids)
    # score only the scored slots: the LM head over 49K+ rows is the dominant cost
    slots = hidden[:, :, 1:]  # (b, A, B-1, D)
    sel = label_valid.nonzero(as_tuple=True)
    logits = lm_head(slots[sel]).float()  # (N, K): K = V, or the draft vocabulary's size
    target = labels[sel]
    column = label_index(target) if label_index is not None else target
    draftable = column >= 0
    k_index = sel[2]  # 0-based slot index, i.e. k-1
    w = position_weights(B, gamma if gamma is not None else cfg.gamma, device=logits.device)[k_index]
    w = w * draftable
    ce = F.cross_entropy(logits, column.clamp(min=0), reduction="none")
    if soft_labels is not None and soft_weight > 0:
        ce = (1 - soft_weight) * ce + soft_weight * soft_cross_entropy(logits, soft_labels, anchor_pos, sel, label_index)
    loss = (w * ce).sum() / w.sum().clamp(min=1e-8)
    with torch.no_grad():
        hit = ((logits.argmax(-1) == column) & draftable).float()
        correct = torch.zeros(B - 1, device=logits.device).index_add_(0, k_index, hit)
        counts = torch.zeros(B - 1, device=logits.device).index_add_(0, k_index, torch.ones_like(hit))
    return LossOutput(loss=loss, correct=correct, counts=counts, num_predictions=int(target.numel()))
