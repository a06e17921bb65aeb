"""Pure tensor functions for DFlash attention masks, anchors, positions, labels and weights.

Every mask is a bool tensor, True = may attend, shaped (b, 1, queries, keys) so it feeds
torch's scaled_dot_product_attention and transformers' 4D-mask path directly. Each function
is tested against a slow loop reference in tests/test_masks.py.

Training layout (one sequence of T tokens, A anchors, block size B), worked example with
T=8, B=3, anchors [2, 5]:
    keys     = [ctx 0..7 | block0 slots 0..2 | block1 slots 0..2]      (8 + 6 keys)
    block0   = tokens [x2, MASK, MASK] at positions [2, 3, 4]; sees ctx 0..1 (strictly
               before its anchor: at inference the anchor has no target features yet) and
               block0's own 3 slots, bidirectionally.
    labels0  = [x3, x4] for slots 1..2 (slot 0, the anchor, is not scored).
    block1   = [x5, MASK, MASK] at [5, 6, 7]; sees ctx 0..4 and its own slots; label [x6, x7].
"""

from __future__ import annotations

import torch


def causal_attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """Prefill mask over one (left-padded) sequence: valid (b, t) bool -> (b, 1, t, t).

    Query i sees key j <= i when key j is valid. Every query also sees itself, so padding
    rows are never fully masked (a fully masked row is NaN in SDPA; NaN * 0 is still NaN).
    """
    t = valid.shape[1]
    idx = torch.arange(t, device=valid.device)
    causal = idx[None, :] <= idx[:, None]  # (t, t): key <= query
    mask = causal[None] & valid[:, None, :]
    mask = mask | torch.eye(t, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None]


def extend_attention_mask(slot_valid: torch.Tensor, new: int, causal: bool) -> torch.Tensor:
    """Mask for `new` queries appended after S cached slots: (b, S) -> (b, 1, new, S + new).

    Cached slots are visible where valid (padding and rejected-draft holes are not); among
    the new tokens, causal (target verify) or bidirectional (drafter block).
    """
    b, s = slot_valid.shape
    past = slot_valid[:, None, :].expand(b, new, s)
    if causal:
        own = torch.ones(new, new, dtype=torch.bool, device=slot_valid.device).tril()
    else:
        own = torch.ones(new, new, dtype=torch.bool, device=slot_valid.device)
    return torch.cat([past, own[None].expand(b, new, new)], dim=-1)[:, None]


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors among response tokens, without replacement, sorted.

    loss_mask (b, T) bool -> anchors (b, A) long, anchor_valid (b, A) bool, with
    A = min(num_anchors, T). Candidates are response positions a < T-1 (so at least one
    label a+1 exists). Rows with fewer candidates than A are padded (valid False, anchor 0).
    """
    b, t = loss_mask.shape
    a = min(num_anchors, t)
    candidates = loss_mask.bool().clone()
    candidates[:, -1] = False
    scores = torch.rand(b, t, generator=generator, device="cpu").to(loss_mask.device)
    scores = torch.where(candidates, scores, torch.full_like(scores, -1.0))
    top, idx = scores.topk(a, dim=1)
    valid = top >= 0
    idx = torch.where(valid, idx, torch.full_like(idx, t))  # invalid sort last
    idx, order = idx.sort(dim=1)
    valid = valid.gather(1, order)
    return torch.where(valid, idx, torch.zeros_like(idx)), valid


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors (b, A) -> position ids of every block slot (b, A*B): anchor + k."""
    k = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + k).flatten(1)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Block tokens [x_anchor, MASK x (B-1)] for every anchor: (b, A*B)."""
    b, a = anchors.shape
    ids = torch.full((b, a, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = input_ids.gather(1, anchors)
    return ids.flatten(1)


def training_attention_mask(
    anchors: torch.Tensor, context_valid: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The DFlash training mask: (b, 1, A*B, T + A*B).

    Block j sees context key t iff t < anchor_j and context_valid[t]; it sees all B slots
    of its own block and nothing of any other block.
    """
    b, a = anchors.shape
    t = context_valid.shape[1]
    pos = torch.arange(t, device=anchors.device)
    ctx = (pos[None, None, :] < anchors[..., None]) & context_valid[:, None, :]  # (b, A, T)
    ctx = ctx[:, :, None, :].expand(b, a, block_size, t).reshape(b, a * block_size, t)
    blk_id = torch.arange(a, device=anchors.device).repeat_interleave(block_size)
    own = (blk_id[:, None] == blk_id[None, :])[None].expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_valid: torch.Tensor, block_size: int,
    target_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels: slot k (1..B-1) of block j predicts token anchor_j + k.

    -> labels (b, A, B-1) long, label_valid (b, A, B-1) bool (in range, response token,
    valid anchor).

    target_ids (b, T), for teacher-forced data (dflash.data: a source text with the
    target's greedy token at each position): slot k's label is then the target's token at
    anchor + k, and the slot counts only while the source tokens at anchor+1 .. anchor+k-1
    equal the target's own, i.e. while the block is still on the target's greedy path.
    Example: input [a b c d e], target [- b X d e], anchor 0, B 4: labels [b X d],
    valid [1 1 0] (slot 3 follows the source's c where the target wrote X).
    """
    t = input_ids.shape[1]
    k = torch.arange(1, block_size, device=anchors.device)
    pos = anchors[..., None] + k  # (b, A, B-1)
    in_range = pos < t
    pos_c = pos.clamp(max=t - 1)
    source = target_ids if target_ids is not None else input_ids
    labels = source.gather(1, pos_c.flatten(1)).view_as(pos)
    scored = loss_mask.bool().gather(1, pos_c.flatten(1)).view_as(pos)
    valid = in_range & scored & anchor_valid[..., None]
    if target_ids is not None:
        agree = (input_ids == target_ids).gather(1, pos_c.flatten(1)).view_as(pos)  # at anchor + k
        on_path = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], -1).long().cumprod(-1).bool()
        valid = valid & on_path
    return labels, valid


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..B-1: early positions matter most (every later
    draft is accepted only if the earlier ones were)."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)
