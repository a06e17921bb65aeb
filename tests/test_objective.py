"""Training objective: train/inference parity and learning on the real default target."""

import torch

from dflash.decoding import SamplingParams, SpeculativeDecoder
from dflash.objective import dflash_loss, drafter_training_hidden, implied_tau
from dflash.training import target_features
from support import padded_batch


def _training_logits(target, drafter, ids, valid, anchors):
    taps = target_features(target, ids, valid, drafter.config.target_layer_ids)
    with torch.no_grad():
        hidden = drafter_training_hidden(drafter, target.embed, ids, taps, valid, anchors)
    return target.lm_head(hidden[:, :, 1:]).float()  # (b, A, B-1, V)


def test_train_inference_parity_after_prefill(target_fp32, trained):
    """Draft logits of the training forward (block mask, many blocks per sequence) equal the
    inference draft (context cache from a left-padded batched prefill)."""
    drafter, _, prompts, outputs = trained
    ids, _, valid = padded_batch(prompts[:2], outputs[:2])
    # several anchors per sequence, inside each response
    offsets = [[1, 5, 9], [2, 4, 8]]
    assert min(len(o) for o in outputs[:2]) > 9
    anchors = torch.tensor([[len(prompts[i]) + k for k in offsets[i]] for i in range(2)])
    train = _training_logits(target_fp32, drafter, ids, valid, anchors)
    dec = SpeculativeDecoder(target_fp32, drafter)
    for j in range(anchors.shape[1]):
        # inference: the prompt is everything before the anchor; prefill emits the anchor
        ctx = [ids[i, : anchors[i, j]].tolist() for i in range(2)]
        batch = dec.prefill(ctx, SamplingParams(4))
        assert batch.anchor.tolist() == [int(ids[i, anchors[i, j]]) for i in range(2)]
        infer = dec.draft_logits(batch)
        torch.testing.assert_close(infer, train[:, j], rtol=1e-4, atol=1e-4)


def test_train_inference_parity_after_verify_cycles(target_fp32, trained):
    """Same, once the context cache has grown through verify passes (holes included)."""
    drafter, _, prompts, outputs = trained
    dec = SpeculativeDecoder(target_fp32, drafter)
    long_ones = sorted(range(len(outputs)), key=lambda i: -len(outputs[i]))[:2]
    assert min(len(outputs[i]) for i in long_ones) > 3 * drafter.config.block_size + 1
    batch = dec.prefill([prompts[i] for i in long_ones], SamplingParams(40))
    for _ in range(3):
        dec.step(batch)
    assert not any(r.finished for r in batch.requests)
    assert not bool(batch.slot_valid.all()), "expected holes from ragged acceptance"
    infer = dec.draft_logits(batch)
    seqs = [r.prompt_ids + r.output_ids for r in batch.requests]
    # training view: the emitted sequence so far; the anchor is the last emitted token
    ids, _, valid = padded_batch([s[:-1] for s in seqs], [[s[-1]] for s in seqs])
    anchors = torch.tensor([[len(s) - 1] for s in seqs])
    train = _training_logits(target_fp32, drafter, ids, valid, anchors)
    torch.testing.assert_close(infer, train[:, 0], rtol=1e-4, atol=1e-4)


def test_learning_reaches_high_accuracy_and_tau(target_fp32, trained):
    drafter, history, prompts, outputs = trained
    first, last = history[0], history[-1]
    assert last["loss"] < 0.1 * first["loss"]
    assert min(last["acc"]) > 0.9, last["acc"]
    res = SpeculativeDecoder(target_fp32, drafter, adaptive=False).generate(prompts, SamplingParams(40))  # tau at its block
    assert [r.output_ids for r in res] == outputs  # still lossless
    tau = sum(r.stats.tau for r in res) / len(res)
    assert tau >= 3.0, tau


def test_loss_weights_and_accuracy_bookkeeping(target_fp32, trained):
    drafter, _, prompts, outputs = trained
    ids, loss_mask, valid = padded_batch(prompts[:2], outputs[:2])
    taps = target_features(target_fp32, ids, valid, drafter.config.target_layer_ids)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        out = dflash_loss(drafter, target_fp32.embed, target_fp32.lm_head, ids, loss_mask, taps, valid,
                          num_anchors=8, generator=g)
    B = drafter.config.block_size
    assert out.counts.shape == (B - 1,) and int(out.counts.sum()) == out.num_predictions
    assert 0 < out.num_predictions <= 2 * 8 * (B - 1)
    assert torch.all(out.correct <= out.counts)
    assert 1.0 <= implied_tau(out.accuracy) <= B
    assert implied_tau([1.0] * (B - 1)) == B and implied_tau([0.0] * (B - 1)) == 1.0


def test_soft_labels_one_hot_equal_hard_labels_and_renormalise(target_fp32, trained):
    """Logit distillation (soft_labels): a one-hot target distribution on the true token is
    the hard loss exactly; spreading it changes the loss; entries outside the draft
    vocabulary are dropped and the rest renormalised."""
    from dflash.drafter import OutputHead
    from dflash.objective import soft_cross_entropy

    drafter, _, prompts, outputs = trained
    ids, loss_mask, valid = padded_batch(prompts[:2], outputs[:2])
    taps = target_features(target_fp32, ids, valid, drafter.config.target_layer_ids)
    b, t = ids.shape
    anchors = (torch.tensor([[len(prompts[0]) + 1, len(prompts[0]) + 6], [len(prompts[1]) + 2, len(prompts[1]) + 5]]),
               torch.ones(2, 2, dtype=torch.bool))
    one_hot = (torch.cat([ids[..., None], torch.zeros(b, t, 1, dtype=torch.long)], -1),
               torch.tensor([1.0, 0.0]).expand(b, t, 2))

    def loss(**kw):
        with torch.no_grad():
            return dflash_loss(drafter, target_fp32.embed, target_fp32.lm_head, ids, loss_mask, taps, valid,
                               anchors=anchors, **kw).loss

    hard = loss()
    torch.testing.assert_close(loss(soft_labels=one_hot, soft_weight=1.0), hard)
    spread = (one_hot[0], torch.tensor([0.5, 0.5]).expand(b, t, 2))
    assert abs(float(loss(soft_labels=spread, soft_weight=1.0) - hard)) > 1e-3
    torch.testing.assert_close(loss(soft_labels=spread, soft_weight=0.0), hard)

    # a draft vocabulary without token 0: the spread pair renormalises to one-hot again
    vocab = torch.arange(1, target_fp32.vocab_size)
    head = OutputHead(target_fp32.model.lm_head.weight, vocab)
    logits = torch.randn(3, vocab.numel())
    sel = (torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), torch.tensor([0, 2, 1]))
    got = soft_cross_entropy(logits, spread, anchors[0], sel, head.index)
    pos = anchors[0][sel[0], sel[1]] + sel[2] + 1
    want = torch.nn.functional.cross_entropy(logits, head.index(ids[sel[0], pos]), reduction="none")
    assert bool((ids[sel[0], pos] != 0).all())
    torch.testing.assert_close(got, want)


def test_a_batch_with_nothing_to_score_gives_a_zero_loss(target_fp32, trained):
    """Rows cut before their first response token (a long prompt at max_seq_len) leave no
    slot to score: the loss is 0 and backward runs, instead of the step crashing."""
    from dflash.config import DrafterConfig
    from dflash.drafter import OutputHead
    from dflash.training import new_drafter

    _, _, prompts, outputs = trained
    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig.for_target(target_fp32, 1, 8, [1, 14, 27]), target_fp32)  # trainable
    ids, loss_mask, valid = padded_batch(prompts[:2], outputs[:2])
    taps = target_features(target_fp32, ids, valid, drafter.config.target_layer_ids)
    head = OutputHead(target_fp32.model.lm_head.weight, torch.arange(0, 4096, 2))
    out = dflash_loss(drafter, target_fp32.embed, head.logits, ids, torch.zeros_like(loss_mask), taps, valid,
                      num_anchors=8, generator=torch.Generator().manual_seed(0), label_index=head.index)
    assert out.num_predictions == 0 and float(out.loss) == 0.0 and int(out.counts.sum()) == 0
    out.loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in drafter.parameters())  # nothing to learn from
