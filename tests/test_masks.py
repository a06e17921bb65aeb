"""Masks, anchors, labels and weights against slow loop references."""

import math

import pytest
import torch

from dflash.config import DrafterConfig, default_gamma, default_target_layer_ids
from dflash.masks import (block_input_ids, block_labels, block_positions, causal_attention_mask,
                          extend_attention_mask, position_weights, sample_anchors, training_attention_mask)


def test_default_target_layer_ids_follow_the_paper_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as published
    assert default_target_layer_ids(30, 1) == [15]
    for n_layers in (8, 30, 36, 80):
        for n in (2, 3, 5):
            ids = default_target_layer_ids(n_layers, n)
            assert ids[0] == 1 and ids[-1] == n_layers - 3
            assert ids == [round(1 + i * (n_layers - 4) / (n - 1)) for i in range(n)]
    with pytest.raises(ValueError):
        default_target_layer_ids(30, 0)


def test_gamma_by_block_size():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def test_causal_attention_mask_matches_loop():
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    got = causal_attention_mask(valid)
    assert got.shape == (2, 1, 5, 5)
    for b in range(2):
        for i in range(5):
            for j in range(5):
                expect = (j <= i and bool(valid[b, j])) or i == j
                assert bool(got[b, 0, i, j]) == expect


@pytest.mark.parametrize("causal", [True, False])
def test_extend_attention_mask_matches_loop(causal):
    slot_valid = torch.tensor([[True, False, True], [False, True, True]])
    got = extend_attention_mask(slot_valid, 4, causal)
    assert got.shape == (2, 1, 4, 7)
    for b in range(2):
        for i in range(4):
            for j in range(7):
                if j < 3:
                    expect = bool(slot_valid[b, j])
                else:
                    expect = (j - 3 <= i) if causal else True
                assert bool(got[b, 0, i, j]) == expect


def test_sample_anchors_are_distinct_sorted_response_positions():
    g = torch.Generator().manual_seed(0)
    loss_mask = torch.zeros(3, 20, dtype=torch.bool)
    loss_mask[0, 5:20] = True
    loss_mask[1, 2:6] = True  # only 4 candidates (positions 2..5), fewer than asked
    loss_mask[2, 19] = True  # the last position is never an anchor: no label after it
    anchors, valid = sample_anchors(loss_mask, 8, g)
    assert anchors.shape == (3, 8)
    for b in range(3):
        picked = anchors[b][valid[b]].tolist()
        assert picked == sorted(set(picked))
        assert all(loss_mask[b, a] and a < 19 for a in picked)
    assert valid[0].sum() == 8 and valid[1].sum() == 4 and valid[2].sum() == 0
    # redrawn each call: another draw differs
    again, _ = sample_anchors(loss_mask, 8, g)
    assert not torch.equal(again[0], anchors[0])


def test_anchor_sampling_is_uniform_over_candidates():
    g = torch.Generator().manual_seed(1)
    loss_mask = torch.zeros(1, 12, dtype=torch.bool)
    loss_mask[0, 2:10] = True  # 8 candidates, draw 2 each time
    counts = torch.zeros(12)
    for _ in range(4000):
        a, v = sample_anchors(loss_mask, 2, g)
        counts[a[0][v[0]]] += 1
    freq = counts[2:10] / counts.sum()
    assert torch.allclose(freq, torch.full((8,), 1 / 8), atol=0.02)


def test_training_mask_matches_loop_reference():
    # worked example of dflash/masks.py: T=8, B=3, anchors [2, 5]
    anchors = torch.tensor([[2, 5], [1, 3]])
    ctx_valid = torch.ones(2, 8, dtype=torch.bool)
    ctx_valid[1, 6:] = False  # padding
    B = 3
    got = training_attention_mask(anchors, ctx_valid, B)
    assert got.shape == (2, 1, 6, 8 + 6)
    for b in range(2):
        for q in range(6):
            jq = q // B
            for k in range(14):
                if k < 8:
                    expect = k < int(anchors[b, jq]) and bool(ctx_valid[b, k])
                else:
                    expect = (k - 8) // B == jq
                assert bool(got[b, 0, q, k]) == expect, (b, q, k)


def test_block_ids_positions_labels_match_loop():
    ids = torch.arange(100, 110)[None]  # tokens 100..109
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 4:9] = True  # response 4..8; 9 is not scored
    anchors = torch.tensor([[4, 7]])
    valid = torch.tensor([[True, True]])
    B = 4
    assert block_input_ids(ids, anchors, B, 0).tolist() == [[104, 0, 0, 0, 107, 0, 0, 0]]
    assert block_positions(anchors, B).tolist() == [[4, 5, 6, 7, 7, 8, 9, 10]]
    labels, lv = block_labels(ids, loss_mask, anchors, valid, B)
    for j, a in enumerate([4, 7]):
        for k in range(1, B):
            pos = a + k
            ok = pos < 10 and bool(loss_mask[0, pos])
            assert bool(lv[0, j, k - 1]) == ok
            if ok:
                assert int(labels[0, j, k - 1]) == 100 + pos


def test_teacher_forced_labels_follow_the_targets_path():
    """The docstring's example, then a loop over every anchor: slot k is labelled with the
    target's token and counts only while the source agreed with the target before it."""
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    target = torch.tensor([[0, 2, 9, 4, 5]])  # the target wrote 9 where the source has 3
    labels, lv = block_labels(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([[0]]),
                              torch.tensor([[True]]), 4, target_ids=target)
    assert labels.tolist() == [[[2, 9, 4]]] and lv.tolist() == [[[True, True, False]]]

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 3, (2, 12), generator=g)
    target = torch.where(torch.rand(2, 12, generator=g) < 0.6, ids, torch.randint(0, 3, (2, 12), generator=g))
    loss_mask = torch.rand(2, 12, generator=g) < 0.8
    anchors = torch.tensor([[0, 3, 6, 9], [1, 2, 5, 10]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    B = 5
    labels, lv = block_labels(ids, loss_mask, anchors, valid, B, target_ids=target)
    plain_labels, plain_lv = block_labels(ids, loss_mask, anchors, valid, B)
    for b in range(2):
        for j in range(4):
            a = int(anchors[b, j])
            for k in range(1, B):
                pos = a + k
                ok = bool(valid[b, j]) and pos < 12 and bool(loss_mask[b, pos])
                assert bool(plain_lv[b, j, k - 1]) == ok  # source labels: no path condition
                ok = ok and all(int(ids[b, a + i]) == int(target[b, a + i]) for i in range(1, k))
                assert bool(lv[b, j, k - 1]) == ok, (b, j, k)
                if ok:
                    assert int(labels[b, j, k - 1]) == int(target[b, pos])


def test_position_weights():
    w = position_weights(16, 7.0)
    assert w.shape == (15,)
    assert [round(x, 6) for x in w.tolist()] == [round(math.exp(-(k - 1) / 7.0), 6) for k in range(1, 16)]


def test_drafter_config_validation():
    base = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                vocab_size=50, num_target_layers=6, target_layer_ids=(1, 3), mask_token_id=49)
    DrafterConfig(**base)
    with pytest.raises(ValueError, match="out of range"):
        DrafterConfig(**{**base, "target_layer_ids": (1, 6)})
    with pytest.raises(ValueError, match="mask_token_id"):
        DrafterConfig(**{**base, "mask_token_id": 50})
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig(**{**base, "block_size": 1})
    cfg = DrafterConfig(**base)
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
