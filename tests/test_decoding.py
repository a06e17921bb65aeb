"""Lossless greedy decoding on the real default target (SmolLM2-135M-Instruct).

fp32: token-for-token equal to transformers' own greedy generate, batched and one at a
time, with a random drafter and with a briefly trained one. bf16: a multi-token verify
rounds differently from one-token steps, so there every emitted token must be the
target's argmax given the emitted prefix, up to BF16_MARGIN logits (re-scored with one
teacher-forced pass).
"""

import pytest
import torch

from dflash.batch import compact, merge
from dflash.config import DrafterConfig
from dflash.decoding import SpeculativeDecoder
from dflash.drafter import DFlashDrafter
from dflash.lookup import LookupConfig
from dflash.masks import causal_attention_mask
from dflash.sampling import SamplingParams
from support import GREEDY_TOKENS as MAX_NEW

BF16_MARGIN = 0.5  # logits; bf16 rounding of a 16-token verify vs 1-token steps stays well inside


@pytest.fixture(scope="module")
def random_drafter(target_fp32):
    torch.manual_seed(123)
    cfg = DrafterConfig.for_target(target_fp32, num_taps=3,
                                   block_size=16)
    return DFlashDrafter(cfg).eval()


def test_prompts_are_varied(prompts):
    assert len(prompts) >= 8 and len({len(p) for p in prompts}) >= 4  # ragged left padding


def test_autoregressive_baseline_equals_hf_greedy(target_fp32, prompts, reference):
    out = SpeculativeDecoder(target_fp32).generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    assert [r.output_ids for r in out] == reference


@pytest.mark.parametrize("which", ["random", "trained"])
@pytest.mark.parametrize("batch_size", [4, 1])
def test_dflash_greedy_is_lossless_fp32(target_fp32, prompts, reference, random_drafter, trained, which, batch_size):
    drafter = random_drafter if which == "random" else trained[0]
    out = SpeculativeDecoder(target_fp32, drafter).generate(prompts, SamplingParams(MAX_NEW), batch_size=batch_size)
    assert [r.output_ids for r in out] == reference
    taus = [r.stats.tau for r in out]
    assert all(1.0 <= t <= drafter.config.block_size for t in taus)
    if which == "trained":  # trained on the first four prompts' answers: accepts far more there
        # (tau measured on the pinned block: adaptive widths make tau a function of the costs)
        pinned = SpeculativeDecoder(target_fp32, drafter, adaptive=False).generate(
            prompts[:4], SamplingParams(MAX_NEW), batch_size=batch_size)
        assert [r.output_ids for r in pinned] == reference[:4]
        assert sum(r.stats.tau for r in pinned) / 4 > 2.0


def test_requests_joining_and_compaction_stay_lossless(target_fp32, prompts, reference, trained):
    """Requests join a running batch between steps; holes are squeezed out every step."""
    dec = SpeculativeDecoder(target_fp32, trained[0])
    batch = dec.prefill(prompts[:3], SamplingParams(MAX_NEW))
    done = []
    for _ in range(2):
        dec.step(batch)
    batch = merge(batch, dec.prefill(prompts[3:6], SamplingParams(MAX_NEW)))
    while batch is not None:
        dec.step(batch)
        batch = compact(batch)
        batch, finished = dec.drop_finished(batch)
        done += finished
    got = {tuple(r.prompt_ids): r.output_ids for r in done}
    assert [got[tuple(p)] for p in prompts[:6]] == reference[:6]


def test_stop_tokens_and_max_new_tokens(target_fp32, prompts, reference, random_drafter):
    dec = SpeculativeDecoder(target_fp32, random_drafter)
    ref = reference[1]
    stop = ref[5]
    out = dec.generate([prompts[1]], SamplingParams(MAX_NEW, stop_token_ids=(stop,)))[0]
    assert out.output_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    out = dec.generate([prompts[1]], SamplingParams(7))[0]
    assert out.output_ids == ref[:7] and out.finish_reason == "length"


def test_ignore_eos_runs_past_the_targets_stop_tokens(target_fp32, prompts, reference, random_drafter):
    """ignore_eos: the target's stop tokens no longer end a request (its own still do). Here a
    token of the greedy answer stands in for the target's end-of-sequence token."""
    dec = SpeculativeDecoder(target_fp32, random_drafter)
    ref = reference[1]
    eos, own = ref[5], ref[-4]
    dec.stop_token_ids = dec.stop_token_ids | {eos}
    out = dec.generate([prompts[1]], SamplingParams(MAX_NEW))[0]
    assert out.output_ids == ref[: ref.index(eos) + 1] and out.finish_reason == "stop"
    out = dec.generate([prompts[1]], SamplingParams(MAX_NEW, ignore_eos=True))[0]
    assert out.output_ids == ref and out.finish_reason == "length"
    out = dec.generate([prompts[1]], SamplingParams(MAX_NEW, ignore_eos=True, stop_token_ids=(own,)))[0]
    assert out.output_ids == ref[: ref.index(own) + 1] and out.finish_reason == "stop"


def _rescore_margins(target, prompt, output):
    """For each emitted token: max logit - logit of the token, teacher-forced in one pass."""
    ids = torch.tensor([prompt + output])
    valid = torch.ones_like(ids, dtype=torch.bool)
    logits = target.forward(ids, torch.arange(ids.shape[1])[None], causal_attention_mask(valid)).logits[0].float()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(output)]
    chosen = rows.gather(1, torch.tensor(output)[:, None]).squeeze(1)
    return rows.max(1).values - chosen


@pytest.mark.parametrize("which", ["random", "trained"])
def test_dflash_greedy_bf16_emits_target_argmax(target_bf16, prompts, random_drafter, trained, which):
    drafter = (random_drafter if which == "random" else trained[0])
    drafter = DFlashDrafter(drafter.config)
    drafter.load_state_dict((random_drafter if which == "random" else trained[0]).state_dict())
    drafter = drafter.to(torch.bfloat16).eval()
    out = SpeculativeDecoder(target_bf16, drafter).generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    worst = 0.0
    for p, r in zip(prompts, out):
        margins = _rescore_margins(target_bf16, p, r.output_ids)
        worst = max(worst, float(margins.max()))
    assert worst <= BF16_MARGIN, f"an emitted token was {worst:.3f} logits below the target's argmax"


@pytest.mark.parametrize("which,lookup,batch_size", [
    ("random", LookupConfig(), 4),  # drafter block 16 > lookup width 8: copies padded
    ("trained", LookupConfig(num_tokens=11), 4),  # lookup width 12 > block 8: drafter rows padded
    ("trained", LookupConfig(num_tokens=3, min_ngram=1), 1),
    ("none", LookupConfig(), 4),  # lookup alone
])
def test_context_lookup_is_lossless_fp32(target_fp32, prompts, reference, random_drafter, trained, which, lookup,
                                         batch_size):
    """Copied and drafted cycles, ragged within one batch, equal greedy AR token for token.
    Pinned width: both kinds of cycle must occur whatever the machine's costs (the adaptive
    policy's own losslessness is tested with controlled costs)."""
    drafter = {"random": random_drafter, "trained": trained[0], "none": None}[which]
    dec = SpeculativeDecoder(target_fp32, drafter, lookup=lookup, adaptive=False)
    out = dec.generate(prompts, SamplingParams(MAX_NEW), batch_size=batch_size)
    assert [r.output_ids for r in out] == reference
    copied = sum(r.stats.lookup_cycles for r in out)
    cycles = sum(len(r.stats.acceptance_lengths) for r in out)
    assert 0 < copied < cycles, "both kinds of cycle must occur for the test to mean something"
    assert max(n for r in out for n in r.stats.acceptance_lengths) > 1


@pytest.mark.parametrize("which,lookup", [("random", None), ("trained", LookupConfig()), ("none", None)])
def test_corpus_drafts_are_lossless_fp32(target_fp32, prompts, reference, random_drafter, trained, which, lookup):
    """A corpus that knows the answers to half the prompts: its drafts, the context's and
    the drafter's, ragged within a batch, still equal greedy AR token for token."""
    from dflash.corpus import CorpusIndex, answer_segments

    segments = [s for p, o in zip(prompts[:4], reference[:4])
                for s in answer_segments(p + o, [0] * len(p) + [1] * len(o))]
    corpus = CorpusIndex.from_segments(segments, target_fp32.vocab_size)
    drafter = {"random": random_drafter, "trained": trained[0], "none": None}[which]
    out = SpeculativeDecoder(target_fp32, drafter, lookup=lookup, corpus=corpus, adaptive=False).generate(
        prompts, SamplingParams(MAX_NEW), batch_size=4)  # pinned: corpus cycles occur whatever the costs
    assert [r.output_ids for r in out] == reference
    from_corpus = sum(r.stats.corpus_cycles for r in out)
    cycles = sum(len(r.stats.acceptance_lengths) for r in out)
    assert 0 < from_corpus < cycles
    known = [n for r in out[:4] for n in r.stats.acceptance_lengths]
    assert sum(known) / len(known) > 3  # the corpus holds these answers: long drafts accepted


def test_context_and_corpus_lookup_bf16_emit_target_argmax(target_bf16, prompts):
    """The shipped drafter with its shipped corpus, as generate/bench/serve run it by default."""
    from dflash.checkpoint import load_drafter, resolve_drafter
    from dflash.corpus import CorpusIndex, resolve_corpus

    path = resolve_drafter("default", target_bf16.target_id)
    drafter = load_drafter(path, target=target_bf16, dtype="bf16")
    corpus = CorpusIndex.load(resolve_corpus("auto", path), target_bf16.vocab_size)
    out = SpeculativeDecoder(target_bf16, drafter, lookup=LookupConfig(), corpus=corpus, adaptive=False).generate(
        prompts, SamplingParams(MAX_NEW), batch_size=4)  # pinned: both kinds of copy occur whatever the costs
    assert sum(r.stats.lookup_cycles for r in out) > 0 and sum(r.stats.corpus_cycles for r in out) > 0
    worst = max(float(_rescore_margins(target_bf16, p, r.output_ids).max()) for p, r in zip(prompts, out))
    assert worst <= BF16_MARGIN, f"an emitted token was {worst:.3f} logits below the target's argmax"


def test_rescoring_catches_a_wrong_token(target_bf16, prompts):
    """The bf16 check has teeth: a substituted token is far below the argmax."""
    out = SpeculativeDecoder(target_bf16).generate(prompts[:1], SamplingParams(16))[0].output_ids
    bad = list(out)
    bad[3] = (bad[3] + 1000) % target_bf16.vocab_size
    assert float(_rescore_margins(target_bf16, prompts[0], bad).max()) > 5 * BF16_MARGIN


def test_prompt_over_context_is_refused(target_fp32):
    dec = SpeculativeDecoder(target_fp32)
    with pytest.raises(ValueError, match="context"):
        dec.prefill([[1] * 10], SamplingParams(max_new_tokens=target_fp32.config.max_position_embeddings))
    with pytest.raises(ValueError, match="empty prompt"):
        dec.prefill([[]], SamplingParams(4))


def test_drafter_for_another_target_is_refused(target_fp32, random_drafter):
    other = random_drafter.config.replace(hidden_size=64, num_target_layers=12, target_layer_ids=(1, 5, 9))
    with pytest.raises(ValueError, match="hidden size 64"):
        SpeculativeDecoder(target_fp32, DFlashDrafter(other))


# --- the reference drafter shipped for the default target (dflash/drafters/) ---------------

def _shipped_drafter(target, dtype: str):
    from dflash.checkpoint import load_drafter, resolve_drafter

    return load_drafter(resolve_drafter("default", target.target_id), target=target, device="cpu", dtype=dtype)


def test_shipped_reference_drafter_is_lossless_and_accepts_drafts(target_fp32, prompts, reference):
    """These chat prompts were never in its training data (regenerated ShareGPT)."""
    drafter = _shipped_drafter(target_fp32, "fp32")
    out = SpeculativeDecoder(target_fp32, drafter).generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    assert [r.output_ids for r in out] == reference
    # its acceptance on the pinned block (adaptive widths make tau a function of the costs)
    out = SpeculativeDecoder(target_fp32, drafter, adaptive=False).generate(prompts, SamplingParams(MAX_NEW),
                                                                            batch_size=4)
    assert [r.output_ids for r in out] == reference
    cycles = [n for r in out for n in r.stats.acceptance_lengths]
    assert sum(cycles) / len(cycles) > 1.2  # measured 1.44; an untrained drafter stays at ~1.0


def test_shipped_reference_drafter_bf16_emits_target_argmax(target_bf16, prompts):
    drafter = _shipped_drafter(target_bf16, "bf16")
    out = SpeculativeDecoder(target_bf16, drafter).generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    worst = max(float(_rescore_margins(target_bf16, p, r.output_ids).max()) for p, r in zip(prompts, out))
    assert worst <= BF16_MARGIN, f"an emitted token was {worst:.3f} logits below the target's argmax"


def test_chunked_prefill_equals_one_pass(target_fp32, prompts, reference, random_drafter):
    """Prefill a chunk of columns at a time (a server between decode steps): the same caches,
    drafter context and outputs as one pass."""
    dec = SpeculativeDecoder(target_fp32, random_drafter)
    params = SamplingParams(MAX_NEW)
    whole = dec.prefill(prompts[:3], params)
    pf = dec.start_prefill(prompts[:3], params)
    chunks = 0
    while (batch := pf.advance(3 * 7)) is None:  # 7 columns of 3 rows a chunk
        chunks += 1
    assert chunks >= 3 and torch.equal(batch.anchor, whole.anchor)
    for (k1, v1), (k2, v2) in zip(batch.context, whole.context):
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
    while batch is not None:
        dec.step(batch)
        batch, _ = dec.drop_finished(batch)
    assert [r.output_ids for r in pf.requests] == reference[:3]


def test_adaptive_width_reports_its_widths_and_pinned_verifies_every_guess(target_fp32, prompts, reference,
                                                                            random_drafter):
    """An untrained drafter rarely pays: the adaptive policy verifies narrower than the pinned
    block (many AR steps among its cycles) and both stay exact."""
    adaptive = SpeculativeDecoder(target_fp32, random_drafter)
    pinned = SpeculativeDecoder(target_fp32, random_drafter, block_size=8, adaptive=False)
    assert adaptive.policy is not None and pinned.policy is None
    assert adaptive.policy.costs.estimate("verify", 1, 1) > 0  # calibrated at start-up
    out_a = adaptive.generate(prompts[:4], SamplingParams(MAX_NEW), batch_size=1)
    out_p = pinned.generate(prompts[:4], SamplingParams(MAX_NEW), batch_size=1)
    assert [r.output_ids for r in out_a] == [r.output_ids for r in out_p] == reference[:4]
    widths_a = [w for r in out_a for w in r.stats.verify_widths]
    widths_p = [w for r in out_p for w in r.stats.verify_widths]
    assert set(widths_p) == {8} and len(widths_a) == sum(len(r.stats.acceptance_lengths) for r in out_a)
    assert sum(widths_a) / len(widths_a) < 8 and 1 in widths_a
