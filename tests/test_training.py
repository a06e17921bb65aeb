"""dflash/training.py on tiny arrays: rows, padded batches, the storage rule for features,
the drafter's init and draft vocabulary, the objective wrapper, the schedule and the
held-out metrics. A 4-layer random Llama (no download) stands in for the target where
one is needed; the real target's runs are in test_train.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflash.config import DrafterConfig
from dflash.drafter import OutputHead
from dflash.masks import causal_attention_mask
from dflash.objective import dflash_loss, implied_tau
from dflash.regenerate import tapped_hidden
from dflash.training import (DrafterObjective, collate, fixed_anchors, fold_tap_scale, heldout_metrics,
                             most_frequent_tokens, new_drafter, read_rows, right_pad, round_to_storage,
                             tap_rms_scale, target_features, token_counts, warmup_cosine)

D = 16  # hidden size of the tiny target


def write_rows(path, ids, masks, hidden):
    """A shard with the distilled token columns and (n, W) float16 hidden rows."""
    width = hidden[0].shape[1]
    flat = pa.array(np.concatenate([h.reshape(-1) for h in hidden]).astype(np.float16), pa.float16())
    offsets = pa.array(np.cumsum([0] + [len(h) for h in hidden]), pa.int32())
    pq.write_table(pa.table({
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
        "hidden": pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, width)),
    }), path)
    return path


@pytest.fixture(scope="module")
def tiny():
    """A random 4-layer Llama as the target (.model, .embed, .device, .dtype) and a
    2-layer drafter config for it (taps 1 and 2, block 4, 8 draftable tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=D, intermediate_size=32, num_attention_heads=2,
                                         num_key_value_heads=1, num_hidden_layers=4, vocab_size=64)).eval()
    target = SimpleNamespace(model=llama, embed=llama.model.embed_tokens, device=torch.device("cpu"),
                             dtype=torch.float32)
    cfg = DrafterConfig(hidden_size=D, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                        vocab_size=64, num_target_layers=4, target_layer_ids=(1, 2), mask_token_id=63,
                        num_hidden_layers=2, block_size=4, draft_vocab_size=8)
    return target, cfg


def tiny_batch(with_taps: bool = True):
    """Two rows (lengths 9 and 6), response from position 2, random taps of width 2*D."""
    g = torch.Generator().manual_seed(1)
    ids = [np.array([1, 2, 3, 4, 5, 6, 7, 3, 4], np.int32), np.array([9, 3, 4, 5, 6, 7], np.int32)]
    masks = [np.array([0, 0] + [1] * (len(i) - 2), np.uint8) for i in ids]
    hidden = [torch.randn(len(i), 2 * D, generator=g).half().numpy() for i in ids] if with_taps else None
    return collate(ids, masks, hidden)


# --- rows and padded batches --------------------------------------------------------------------

def test_read_rows_cuts_rows_and_stops_at_max_rows(tmp_path):
    h = [np.arange(4 * 2, dtype=np.float16).reshape(4, 2), np.ones((3, 2), np.float16)]
    a = write_rows(tmp_path / "a.parquet", [[1, 2, 3, 4], [5, 6, 7]], [[0, 1, 1, 1], [0, 0, 1]], h)
    b = write_rows(tmp_path / "b.parquet", [[8, 9]], [[1, 1]], [np.zeros((2, 2), np.float16)])
    ids, masks, hidden = read_rows([a, b], max_seq_len=3, with_hidden=True)
    assert [i.tolist() for i in ids] == [[1, 2, 3], [5, 6, 7], [8, 9]]
    assert [m.tolist() for m in masks] == [[0, 1, 1], [0, 0, 1], [1, 1]]
    assert [x.shape for x in hidden] == [(3, 2), (3, 2), (2, 2)] and hidden[0][2].tolist() == [4, 5]
    ids, masks, hidden = read_rows([a, b], max_rows=1)
    assert [i.tolist() for i in ids] == [[1, 2, 3, 4]] and len(masks) == 1 and hidden is None


def test_right_pad_and_collate():
    ids, valid = right_pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and valid.tolist() == [[1, 1, 1], [1, 0, 0]]
    mb = tiny_batch()
    assert mb.input_ids.dtype == torch.long and mb.input_ids.shape == (2, 9)
    assert mb.valid.sum(1).tolist() == [9, 6] and mb.tokens == 15
    assert mb.loss_mask[1].tolist() == [False, False, True, True, True, True, False, False, False]
    assert mb.taps.dtype == torch.float16 and mb.taps.shape == (2, 9, 2 * D)
    assert bool((mb.taps[1, 6:] == 0).all()) and bool((mb.taps[1, :6] != 0).any())
    assert tiny_batch(with_taps=False).taps is None


# --- features: one rule for online and offline ----------------------------------------------------

class HugeTarget:
    """tapped_features gives +-token id x 1e4 (ids >= 7 leave the float16 range) per tap."""

    device = torch.device("cpu")

    def tapped_features(self, ids, positions, mask, layer_ids):
        assert positions.tolist() == [list(range(ids.shape[1]))] * ids.shape[0]
        assert torch.equal(mask, causal_attention_mask(ids != 0))  # the rows' own valid tokens, causal
        x = ids.float()[..., None] * 1e4
        return torch.cat([x, -x] * len(layer_ids), -1)  # (b, T, 2 * n_taps)


def test_online_features_are_stored_as_offline_ones_even_beyond_fp16():
    """The trainer's online features (round_to_storage of target_features) equal what
    distillation stores (tapped_hidden), also where the target exceeds the float16 range:
    both are clamped to +-65504, none turns inf."""
    seqs = [[1, 7, 2], [9]]
    offline = tapped_hidden(HugeTarget(), seqs, (3, 5))
    ids, valid = right_pad(seqs)
    online = round_to_storage(target_features(HugeTarget(), ids, valid, (3, 5)))
    for i, s in enumerate(seqs):
        assert np.array_equal(online[i, : len(s)].numpy(), offline[i])
    assert offline[0][1].tolist() == [65504.0, -65504.0] * 2 and offline[0][0].tolist() == [1e4, -1e4] * 2
    assert round_to_storage(torch.tensor([7e4, -1e9, 1.0 / 3])).tolist() == [65504.0, -65504.0,
                                                                             float(np.float16(1 / 3))]


# --- the drafter to train ------------------------------------------------------------------------

def test_new_drafter_inits_and_draft_vocabulary(tiny):
    target, cfg = tiny
    torch.manual_seed(0)
    random = new_drafter(cfg, target, "random", draft_vocab=(7, 3, 5, 1, 2, 4, 6, 8))
    assert random.draft_vocab.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    zero = new_drafter(cfg, target, "zero_output")
    for layer in zero.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert random.layers[0].self_attn.o_proj.weight.any()
    copied = new_drafter(cfg, target, "target")
    theirs = target.model.model.layers
    for mine, src in zip(copied.layers, theirs[-2:]):  # the target's last 2 layers
        assert torch.equal(mine.self_attn.q_proj.weight, src.self_attn.q_proj.weight)
        assert torch.equal(mine.mlp.down_proj.weight, src.mlp.down_proj.weight)
        assert torch.equal(mine.input_layernorm.weight, src.input_layernorm.weight)
    assert torch.equal(copied.norm.weight, target.model.model.norm.weight)
    fc = copied.fc.weight  # (D, 2*D): selects the deepest tap
    assert torch.equal(fc[:, D:], torch.eye(D)) and not fc[:, :D].any()
    with pytest.raises(ValueError, match="init must be one of"):
        new_drafter(cfg, target, "copy")


def test_token_counts_and_most_frequent_tokens():
    ids = [np.array([1, 3, 3, 2]), np.array([1, 1, 3, 7])]
    masks = [np.array([0, 1, 1, 1]), np.array([1, 1, 0, 1])]
    assert token_counts(ids, masks, 8).tolist() == [0, 2, 1, 2, 0, 0, 0, 1]
    assert most_frequent_tokens(np.array([0, 5, 2, 5]), 2) == (1, 3)
    assert most_frequent_tokens(np.array([0, 5, 2, 5]), 4) == (0, 1, 2, 3)  # ties go to the lower id
    assert most_frequent_tokens(np.array([0, 0, 9]), 1) == (2,)


# --- the objective, tap scaling, the schedule ----------------------------------------------------

def test_objective_scales_taps_and_scores_the_draft_vocabulary(tiny):
    """DrafterObjective(taps) == dflash_loss(taps * scale) over the draft vocabulary; the
    scale is a buffer (it travels in checkpoints); folding it into fc gives raw-tap weights."""
    target, cfg = tiny
    torch.manual_seed(0)
    drafter = new_drafter(cfg, target, "random", draft_vocab=range(1, 9))
    scale = tuple(float(s) for s in torch.linspace(0.5, 2.0, 2 * D))
    objective = DrafterObjective(drafter, target, num_anchors=3, tap_scale=scale)
    assert "tap_scale" in objective.state_dict() and "tap_scale" not in DrafterObjective(drafter, target, 3).state_dict()
    mb = tiny_batch()
    got = objective(mb.input_ids, mb.loss_mask, mb.taps, mb.valid, torch.Generator().manual_seed(4))
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    s = torch.tensor(scale)
    want = dflash_loss(drafter, target.embed, head.logits, mb.input_ids, mb.loss_mask, mb.taps.float() * s, mb.valid,
                       num_anchors=3, generator=torch.Generator().manual_seed(4), label_index=head.index)
    assert torch.equal(got.loss, want.loss) and torch.equal(got.counts, want.counts)
    x = torch.randn(5, 2 * D)
    before = drafter.fc(x * s)
    torch.testing.assert_close(fold_tap_scale(drafter, s).fc(x), before)


def test_tap_rms_scale_leaves_out_position_0_and_reads_max_rows(tmp_path):
    rows = [np.array([[1000, 1000], [3, 4], [-3, 4]], np.float16), np.array([[1000, 1000], [30, 40]], np.float16)]
    f = write_rows(tmp_path / "a.parquet", [[1, 2, 3], [4, 5]], [[1, 1, 1], [1, 1]], rows)
    assert tap_rms_scale([f], max_rows=1) == pytest.approx((1 / 3, 1 / 4))
    rms = np.sqrt((np.array([9 + 9 + 900, 16 + 16 + 1600])) / 3)
    assert tap_rms_scale([f]) == pytest.approx(tuple(1 / rms))


def test_warmup_cosine_schedule():
    f = warmup_cosine(100, 0.04)  # 4 warmup steps, then cosine to 0 at step 100
    assert [round(f(s), 4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert f(52) == pytest.approx(0.5)
    assert f(100) == pytest.approx(0.0, abs=1e-12)
    assert f(76) == pytest.approx(0.5 * (1 + math.cos(math.pi * 72 / 96)))
    assert warmup_cosine(10, 0.0)(0) == 1.0


# --- held-out evaluation ---------------------------------------------------------------------------

def test_heldout_metrics_at_fixed_anchors(tiny):
    target, cfg = tiny
    torch.manual_seed(0)
    drafter = new_drafter(cfg, target, "random", draft_vocab=range(1, 9)).train()
    mb = tiny_batch()
    anchors, valid = fixed_anchors(mb, num_anchors=3)
    again = fixed_anchors(mb, num_anchors=3)
    assert torch.equal(anchors, again[0]) and torch.equal(valid, again[1])
    assert bool((mb.loss_mask.gather(1, anchors) | ~valid).all())  # anchors sit on response tokens
    got = heldout_metrics(drafter, target, mb, mb.taps.float(), (anchors, valid))
    assert drafter.training  # the mode it came in with
    head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
    with torch.no_grad():
        want = dflash_loss(drafter.eval(), target.embed, head.logits, mb.input_ids, mb.loss_mask, mb.taps.float(),
                           mb.valid, anchors=(anchors, valid), label_index=head.index)
    acc = want.accuracy.tolist()
    assert got == {"eval_loss": round(float(want.loss), 4), "eval_accuracy": [round(a, 4) for a in acc],
                   "eval_implied_tau": round(implied_tau(acc), 4)}
    assert len(got["eval_accuracy"]) == cfg.block_size - 1
