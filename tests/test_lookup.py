"""Context lookup (dflash.lookup): the incremental n-gram index against a brute-force search."""

import random

import pytest

from dflash.lookup import LookupConfig, NgramIndex


def brute_force(tokens: list[int], cfg: LookupConfig, last: int | None = None) -> list[int] | None:
    """The longest suffix (max_ngram..min_ngram) that occurred earlier (ending before `last`,
    by default the final token); copy what followed its latest earlier occurrence,
    continuing into the copy when it runs off the end."""
    last = len(tokens) - 1 if last is None else last
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if n > len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        ends = [e for e in range(n - 1, last) if tokens[e - n + 1: e + 1] == suffix]
        if ends:
            ext = list(tokens)
            for m in range(cfg.num_tokens):
                ext.append(ext[ends[-1] + 1 + m])
            return ext[len(tokens):]
    return None


@pytest.mark.parametrize("cfg", [LookupConfig(), LookupConfig(3, 2, 1), LookupConfig(5, 4, 2)])
def test_index_proposes_what_a_brute_force_search_finds(cfg):
    rng = random.Random(0)
    matched = unmatched = 0
    for trial in range(200):
        vocab = rng.choice([3, 6, 20])  # small vocabularies repeat often, large ones rarely
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        index = NgramIndex(cfg, tokens[:5])
        for tok in tokens[5:]:  # incremental extension, one emitted token at a time
            index.extend([tok])
        want = brute_force(tokens, cfg)
        assert index.propose() == want, (tokens, cfg)
        assert NgramIndex(cfg, tokens).propose() == want
        matched += want is not None
        unmatched += want is None
    assert matched > 20 and unmatched > 20  # both branches exercised


@pytest.mark.parametrize("cfg", [LookupConfig(), LookupConfig(3, 2, 1)])
def test_lookup_after_extra_tokens_matches_brute_force(cfg):
    """propose(extra) looks up as if extra were appended, among occurrences that end before
    the indexed sequence's last token (a draft tree's runner-up first tokens)."""
    rng = random.Random(1)
    found = 0
    for _ in range(300):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 30))]
        extra = [rng.randrange(5) for _ in range(rng.randrange(1, 3))]
        got = NgramIndex(cfg, tokens).propose(extra)
        assert got == brute_force(tokens + extra, cfg, last=len(tokens) - 1)
        found += got is not None
    assert found > 100


def test_the_docstring_example():
    index = NgramIndex(LookupConfig(num_tokens=4, max_ngram=2, min_ngram=1), [5, 6, 7, 8, 5, 6])
    assert index.propose() == [7, 8, 5, 6] and index.propose([7]) == [8, 5, 6, 7]
    assert NgramIndex(LookupConfig(num_tokens=5, max_ngram=2, min_ngram=1), [1, 2, 3, 1, 2]).propose() == \
        [3, 1, 2, 3, 1]


def test_a_loop_continues_with_its_period():
    index = NgramIndex(LookupConfig(num_tokens=5), [5, 6, 7, 5, 6, 7, 5, 6])
    assert index.propose() == [7, 5, 6, 7, 5]
    index.extend([9])
    assert index.propose() is None  # (5, 6, 9) and (6, 9) never occurred before


def test_longest_suffix_wins_over_a_later_shorter_match():
    # (1, 2, 3) occurred at the start; (2, 3) alone occurred later followed by 8
    index = NgramIndex(LookupConfig(num_tokens=2), [1, 2, 3, 4, 4, 0, 2, 3, 8, 8, 1, 2, 3])
    assert index.propose() == [4, 4]
    index = NgramIndex(LookupConfig(num_tokens=2), [9, 2, 3, 4, 4, 0, 2, 3, 8, 8, 1, 2, 3])
    assert index.propose() == [8, 8]  # only (2, 3) matches: its latest occurrence


@pytest.mark.parametrize("kwargs", [{"num_tokens": 0}, {"min_ngram": 0}, {"max_ngram": 1, "min_ngram": 2}])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        LookupConfig(**kwargs)
