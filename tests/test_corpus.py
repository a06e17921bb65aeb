"""Corpus lookup (dflash.corpus): the vectorised tables against a brute-force count, storage,
and decoding with a corpus staying lossless (fp32 greedy: token for token)."""

import random
from collections import Counter

import numpy as np
import pytest

from dflash.corpus import ORDERS, CorpusIndex, _most_frequent_next, answer_segments


def brute_next(segments: list[list[int]], context: list[int]) -> int | None:
    """Count every continuation of the longest known suffix inside one segment; most
    frequent wins, ties to the smaller id."""
    for n in ORDERS:
        if len(context) < n:
            continue
        suffix = context[-n:]
        counts = Counter(s[i + n] for s in segments for i in range(len(s) - n) if s[i: i + n] == suffix)
        if counts:
            return min(counts, key=lambda t: (-counts[t], t))
    return None


def test_the_docstring_examples():
    corpus = CorpusIndex.from_segments([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4, 5, 7]], 10, num_tokens=4)
    assert corpus.propose([0, 1, 2, 3, 4]) == [5, 7] and corpus.propose([8, 8, 2, 3, 4]) == [5, 7]
    assert corpus.propose([2, 3]) is None
    keys, nexts = _most_frequent_next(np.array([7, 3, 7, 7, 3], dtype=np.uint64), np.array([1, 2, 2, 1, 0]))
    assert keys.tolist() == [3, 7] and nexts.tolist() == [0, 1]


@pytest.mark.parametrize("vocab", [3, 7, 50])
def test_tables_give_what_a_brute_force_count_gives(vocab):
    rng = random.Random(vocab)
    segments = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(40)]
    index = CorpusIndex.from_segments(segments, vocab, num_tokens=4)
    found = unknown = 0
    for _ in range(300):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        seg = rng.choice(segments)
        if rng.random() < 0.5 and len(seg) > 4:  # half the time a context the corpus has seen
            i = rng.randrange(len(seg) - 3)
            context = context[:2] + seg[i: i + rng.randrange(3, 6)]
        want = brute_next(segments, context)
        assert index.next_token(context) == want, context
        found += want is not None
        unknown += want is None
        # propose chains next_token over its own output
        chain, ctx = [], list(context)
        while len(chain) < 4 and (t := brute_next(segments, ctx)) is not None:
            chain.append(t)
            ctx.append(t)
        assert index.propose(context) == (chain or None)
    assert found > 30 and unknown > 10  # both branches exercised


def test_ngrams_never_span_two_segments():
    index = CorpusIndex.from_segments([[1, 2, 3, 4], [5, 6, 7, 8]], vocab_size=10)
    assert index.next_token([2, 3, 4]) is None  # 4 ends a segment: 5 does not follow it
    assert index.next_token([1, 2, 3]) == 4
    assert index.propose([9, 5, 6, 7]) == [8]


def test_a_hashed_key_still_finds_its_ngram():
    vocab = 200_000  # vocab**4 > 2**64: keys wrap around, lookups must still agree
    seg = [199_999, 123_456, 7, 150_000, 42, 199_998]
    index = CorpusIndex.from_segments([seg], vocab)
    assert index.tokens.dtype == np.int32
    assert index.propose(seg[:4]) == [42, 199_998]


def test_save_and_load_round_trip(tmp_path):
    rng = random.Random(1)
    segments = [[rng.randrange(100) for _ in range(50)] for _ in range(10)]
    index = CorpusIndex.from_segments(segments, 100)
    path = index.save(tmp_path / "corpus.safetensors")
    loaded = CorpusIndex.load(path, 100)
    assert np.array_equal(loaded.tokens, index.tokens) and np.array_equal(loaded.offsets, index.offsets)
    for n in ORDERS:
        assert all(np.array_equal(a, b) for a, b in zip(loaded.tables[n], index.tables[n]))
    with pytest.raises(ValueError, match="vocabulary"):
        CorpusIndex.load(path, 1000)


def test_bad_corpus_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        CorpusIndex.from_segments([[1, 2, 300]], vocab_size=100)
    with pytest.raises(ValueError, match="offsets"):
        CorpusIndex(np.array([1, 2, 3]), np.array([0, 2]), vocab_size=10)


def test_answer_segments_keep_the_lead_tokens_before_each_answer():
    ids = [10, 11, 12, 13, 20, 21, 14, 15, 16, 30, 31, 32]
    mask = [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    assert answer_segments(ids, mask, lead=3) == [[11, 12, 13, 20, 21], [14, 15, 16, 30, 31, 32]]
    assert answer_segments(ids[4:], mask[4:], lead=3) == [[20, 21], [14, 15, 16, 30, 31, 32]]


def test_shipped_corpus_is_what_its_reference_config_writes():
    """The committed corpus is `dflash corpus` over `dflash distill --config
    jobs/configs/reference/corpus.yaml`: one answer per planned sample, generated with the
    recipe's settings, for the default target; small enough to ship beside the drafter."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    from dflash.checkpoint import reference_drafter_dir
    from dflash.config_file import load_config
    from dflash.corpus import CORPUS_FILE
    from pipelines.distill import DistillConfig

    repo = Path(__file__).resolve().parents[1]
    recipe = load_config(DistillConfig, repo / "jobs/configs/reference/corpus.yaml").as_dict()
    assert recipe["features"] == "none" and recipe["split"] == "train"
    path = reference_drafter_dir("default:SmolLM2-135M-Instruct") / CORPUS_FILE
    assert path.stat().st_size < 8e6
    with safe_open(str(path), framework="numpy") as f:
        meta, offsets = f.metadata(), f.get_tensor("offsets")
    assert meta["target_id"] == "default:SmolLM2-135M-Instruct"
    generation = json.loads(meta["generation"])
    for key in ("max_new_tokens", "max_turns", "max_seq_len", "temperature", "seed", "batch_size"):
        assert generation[key] == recipe[key], key
    assert len(offsets) - 1 == recipe["limit"] and recipe["max_turns"] == 1  # first turns: one answer each
