"""A drafter restricted to the K most frequent response tokens: the head, the loss, the
checkpoint, the training data's token counts, and lossless decoding with the real target.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.checkpoint import CheckpointError, load_drafter, reference_drafter_dir, save_drafter
from dflash.config import DrafterConfig
from dflash.decoding import SamplingParams, SpeculativeDecoder
from dflash.drafter import DFlashDrafter, OutputHead
from dflash.objective import dflash_loss
from pipelines.train_data import DataInfo, most_frequent_tokens, response_token_counts
from support import CHAT_PROMPTS, chat_prompt_ids, hf_greedy, padded_batch, target_taps


def small_vocab_drafter(target, k: int, seed: int = 0, block_size: int = 8) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, num_taps=3, block_size=block_size, draft_vocab_size=k)
    drafter = DFlashDrafter(cfg).eval()
    drafter.set_draft_vocab(torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed))[:k])
    return drafter


def test_head_scores_only_the_vocabulary_and_maps_labels():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(10, 4, generator=g)
    vocab = torch.tensor([1, 4, 7])
    head, full_head = OutputHead(w, vocab), OutputHead(w, None)
    h = torch.randn(2, 3, 4, generator=g)
    sub = head.logits(h)
    assert sub.shape == (2, 3, 3)
    full = head.full(sub)
    ref = full_head.logits(h)
    # a 3-row and a 10-row product may take different BLAS kernels: equal up to rounding, not bitwise
    torch.testing.assert_close(full[..., vocab], ref[..., vocab], rtol=1e-6, atol=1e-6)
    outside = torch.tensor([0, 2, 3, 5, 6, 8, 9])
    assert torch.isinf(full[..., outside]).all() and (full[..., outside] < 0).all()
    assert head.index(torch.tensor([4, 0, 7, 1])).tolist() == [1, -1, 2, 0]
    assert torch.equal(full_head.full(ref), ref) and full_head.index(torch.tensor([3])).tolist() == [3]


def test_set_draft_vocab_checks_its_ids(target_fp32):
    d = small_vocab_drafter(target_fp32, 16)
    assert d.draft_vocab.tolist() == sorted(d.draft_vocab.tolist())
    for bad in ([1] * 16, list(range(15)), list(range(target_fp32.vocab_size - 8, target_fp32.vocab_size + 8))):
        with pytest.raises(ValueError):
            d.set_draft_vocab(bad)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        d.config.replace(draft_vocab_size=1)


def test_checkpoint_keeps_the_ids_exact_in_bf16(tmp_path, target_fp32):
    d = small_vocab_drafter(target_fp32, 300, seed=1)
    assert int(d.draft_vocab.max()) > 1000  # bf16 would round ids this large
    save_drafter(d, tmp_path / "d", dtype="bf16")
    back = load_drafter(tmp_path / "d", target=target_fp32, dtype="bf16")
    assert back.config.draft_vocab_size == 300 and back.draft_vocab.dtype == torch.long
    assert torch.equal(back.draft_vocab, d.draft_vocab) and back.fc.weight.dtype == torch.bfloat16


def test_loss_ignores_undraftable_labels_but_counts_them_as_misses(target_fp32):
    prompts = chat_prompt_ids(target_fp32, CHAT_PROMPTS[:2])
    outputs = [r.output_ids for r in SpeculativeDecoder(target_fp32).generate(prompts, SamplingParams(12))]
    ids, loss_mask, valid = padded_batch(prompts, outputs)
    response = sorted({t for o in outputs for t in o})
    d = small_vocab_drafter(target_fp32, 64, seed=2)
    d.set_draft_vocab((response[: len(response) // 2] + [t for t in range(target_fp32.vocab_size)
                                                          if t not in response])[:64])
    taps = target_taps(target_fp32, ids, valid, d.config.target_layer_ids)
    head = OutputHead(target_fp32.model.lm_head.weight, d.draft_vocab)
    anchors = torch.tensor([[len(prompts[0])], [len(prompts[1])]]), torch.ones(2, 1, dtype=torch.bool)
    out = dflash_loss(d, target_fp32.embed, head.logits, ids, loss_mask, taps, valid, anchors=anchors,
                      label_index=head.index)
    assert torch.isfinite(out.loss) and out.loss > 0
    assert out.counts.sum() == out.num_predictions and out.num_predictions > 0  # every scored label is counted
    # with no draftable label at all the loss is 0 (nothing to learn) and nothing is a hit
    d.set_draft_vocab([t for t in range(target_fp32.vocab_size) if t not in response][:64])
    head = OutputHead(target_fp32.model.lm_head.weight, d.draft_vocab)
    out = dflash_loss(d, target_fp32.embed, head.logits, ids, loss_mask, taps, valid, anchors=anchors,
                      label_index=head.index)
    assert out.loss == 0 and out.correct.sum() == 0 and out.counts.sum() > 0


def test_token_counts_and_most_frequent(tmp_path):
    table = pa.table({"input_ids": pa.array([[5, 1, 1, 2], [1, 3, 3, 3]], pa.list_(pa.int32())),
                      "loss_mask": pa.array([[0, 1, 1, 1], [0, 1, 1, 1]], pa.list_(pa.uint8()))})
    pq.write_table(table, tmp_path / "part-00000.parquet")
    info = DataInfo((str(tmp_path / "part-00000.parquet"),), 2, None)
    counts = response_token_counts(info, 8)
    assert counts.tolist() == [0, 2, 1, 3, 0, 0, 0, 0]  # prompt tokens (5, and the second row's 1) are not counted
    assert most_frequent_tokens(counts, 2) == (1, 3)
    assert most_frequent_tokens(counts, 4) == (0, 1, 2, 3)  # ties go to the lower id
    assert most_frequent_tokens(np.array([0, 0, 9]), 1) == (2,)


@pytest.mark.parametrize("k", [48, 4096])
def test_decoding_is_lossless_fp32_and_drafts_only_the_vocabulary(target_fp32, k):
    prompts = chat_prompt_ids(target_fp32, CHAT_PROMPTS[:3])
    reference = [hf_greedy(target_fp32, p, 24) for p in prompts]
    d = small_vocab_drafter(target_fp32, k, seed=3)
    # make the reference tokens draftable for the larger vocabulary, so drafts are accepted too
    if k > 1000:
        keep = sorted({t for r in reference for t in r})
        rest = [t for t in d.draft_vocab.tolist() if t not in keep]
        d.set_draft_vocab(keep + rest[: k - len(keep)])
    dec = SpeculativeDecoder(target_fp32, d)
    batch = dec.prefill(prompts, SamplingParams(24))
    q = dec.draft_logits(batch)
    allowed = torch.zeros(target_fp32.vocab_size, dtype=torch.bool)
    allowed[d.draft_vocab] = True
    assert torch.isinf(q[..., ~allowed]).all() and torch.isfinite(q[..., allowed]).all()
    out = dec.generate(prompts, SamplingParams(24), batch_size=3)
    assert [r.output_ids for r in out] == reference


# --- on disk: vLLM's layout (draft_vocab_size, d2t, lm_head.weight), and the legacy one -------

def legacy_copy(src, out):
    """The layout this project wrote before vLLM's: a `draft_vocab` id tensor, the size in
    dflash_config, no d2t and no lm_head."""
    out.mkdir(parents=True)
    state = load_file(str(src / "model.safetensors"))
    d2t = state.pop("d2t")
    state.pop("lm_head.weight")
    state["draft_vocab"] = torch.arange(d2t.numel()) + d2t
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["dflash_config"]["draft_vocab_size"] = cfg.pop("draft_vocab_size")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_reduced_vocabulary_is_stored_as_vllm_stores_it(tmp_path, target_fp32):
    d = small_vocab_drafter(target_fp32, 300, seed=1)
    save_drafter(d, tmp_path / "d", dtype="bf16")  # the default target's head, read by its id
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 300 and "draft_vocab_size" not in cfg["dflash_config"]
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "draft_vocab" not in state and state["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(300) + state["d2t"], d.draft_vocab)  # target id = draft id + d2t[draft id]
    head = target_fp32.model.lm_head.weight.detach()
    assert torch.equal(state["lm_head.weight"], head[d.draft_vocab].to(torch.bfloat16))
    # the head given explicitly, whole or as the vocabulary's rows, writes the same tensors
    for given in (head, head[d.draft_vocab]):
        save_drafter(d, tmp_path / "e", dtype="bf16", lm_head_weight=given)
        again = load_file(str(tmp_path / "e" / "model.safetensors"))
        assert all(torch.equal(again[k], state[k]) for k in state)
    with pytest.raises(CheckpointError, match="pass lm_head_weight"):
        save_drafter(DFlashDrafter(d.config.replace(target_id="hf:other")), tmp_path / "f")


def test_worked_example_of_d2t(tmp_path, target_fp32):
    d = small_vocab_drafter(target_fp32, 3)
    d.set_draft_vocab([40, 5, 9])
    save_drafter(d, tmp_path, lm_head_weight=target_fp32.model.lm_head.weight)
    assert load_file(str(tmp_path / "model.safetensors"))["d2t"].tolist() == [5, 8, 38]


def test_legacy_draft_vocab_checkpoint_still_loads(tmp_path, target_fp32):
    d = small_vocab_drafter(target_fp32, 300, seed=1)
    save_drafter(d, tmp_path / "new", dtype="fp32")
    old = legacy_copy(tmp_path / "new", tmp_path / "old")
    back = load_drafter(old, target=target_fp32)
    assert back.config == d.config
    for (k, a), b in zip(d.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k


def test_any_d2t_order_loads_and_a_head_not_the_targets_is_refused(tmp_path, target_fp32):
    d = small_vocab_drafter(target_fp32, 64, seed=4)
    save_drafter(d, tmp_path / "d", dtype="fp32")
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    ids = d.draft_vocab[perm]  # another producer's draft-id order
    state["d2t"] = ids - torch.arange(64)
    state["lm_head.weight"] = target_fp32.model.lm_head.weight.detach()[ids].clone()
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    assert torch.equal(load_drafter(tmp_path / "d", target=target_fp32).draft_vocab, d.draft_vocab)
    state["lm_head.weight"] = state["lm_head.weight"] + 0.1  # a head of its own
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lm_head.weight is not the target's"):
        load_drafter(tmp_path / "d", target=target_fp32)
    del state["d2t"]
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="draft_vocab_size 64 but the weights hold no d2t"):
        load_drafter(tmp_path / "d")


def test_shipped_drafter_is_in_vllm_layout_with_the_legacy_layouts_logits(tmp_path, target_bf16):
    ref = reference_drafter_dir(target_bf16.target_id)
    state = load_file(str(ref / "model.safetensors"))
    assert "draft_vocab" not in state and {"d2t", "lm_head.weight"} <= set(state)
    shipped = load_drafter(ref, target=target_bf16, dtype="bf16")  # the head rows are the target's
    assert torch.equal(state["lm_head.weight"], target_bf16.model.lm_head.weight[shipped.draft_vocab])
    legacy = load_drafter(legacy_copy(ref, tmp_path / "legacy"), target=target_bf16, dtype="bf16")
    prompts = chat_prompt_ids(target_bf16, CHAT_PROMPTS[:2])
    logits = []
    for d in (shipped, legacy):
        dec = SpeculativeDecoder(target_bf16, d)
        logits.append(dec.draft_logits(dec.prefill(prompts, SamplingParams(8))))
    assert torch.equal(logits[0], logits[1])
