"""Draft trees (dflash.tree): the trie layout, the walk, and lossless decoding through them.

fp32: token-for-token equal to transformers' greedy generate, batched with ragged trees;
bf16: every emitted token is the target's argmax up to the near-tie margin. The T > 0 law
is checked in tests/test_sampling.py.
"""

import pytest
import torch

from dflash.corpus import CorpusIndex, answer_segments
from dflash.decoding import SpeculativeDecoder
from dflash.lookup import LookupConfig
from dflash.sampling import SamplingParams
from dflash.tree import TreeConfig, build_tree
from support import GREEDY_TOKENS as MAX_NEW
from test_decoding import BF16_MARGIN, _rescore_margins, _shipped_drafter



def test_trie_layout_of_the_docstring_example():
    tree = build_tree([7], [[([1, 2, 3], "drafter"), ([1, 4], "corpus"), ([5], "lookup")]], max_nodes=16)
    assert tree.tokens.tolist() == [[7, 1, 2, 3, 4, 5]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 1, 0]]
    assert tree.depth.tolist() == [[0, 1, 2, 3, 2, 1]]
    assert tree.source[0] == [None, "drafter", "drafter", "drafter", "corpus", "lookup"]
    ancestors = {n: {m for m in range(6) if tree.attend[0, n, m]} for n in range(6)}
    assert ancestors == {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 1, 2, 3}, 4: {0, 1, 4}, 5: {0, 5}}


def test_budget_ragged_rows_and_padding():
    tree = build_tree([7, 8], [[([1, 2, 3], "drafter"), ([4, 5], "corpus")], []], max_nodes=4)
    assert tree.tokens.tolist()[0] == [7, 1, 2, 3]  # the second branch did not fit
    assert tree.width == 4 and tree.parents[1].tolist() == [-1, -1, -1, -1]
    assert torch.equal(tree.attend[1], torch.eye(4, dtype=torch.bool))  # padding sees only itself
    with pytest.raises(ValueError):
        TreeConfig(max_nodes=1)


def test_walk_follows_the_target_tokens():
    tree = build_tree([7, 7], [[([1, 2, 3], "drafter"), ([1, 4, 9], "corpus")]] * 2, max_nodes=16)
    # nodes: 0:7 1:1 2:2 3:3 4:4 5:9; the target's token at each node
    paths, bonus = tree.walk([[1, 4, 0, 0, 9, 6], [5, 4, 0, 0, 0, 0]])
    assert paths == [[0, 1, 4, 5], [0]] and bonus == [6, 5]


@pytest.mark.parametrize("with_drafter,tree", [
    (True, TreeConfig(max_nodes=24, first_candidates=4)),
    (True, TreeConfig(max_nodes=6, first_candidates=2)),  # a tight budget truncates branches
    (False, TreeConfig()),  # lookup and corpus alone
])
def test_tree_decoding_is_lossless_fp32(target_fp32, prompts, reference, with_drafter, tree):
    """The shipped drafter, context lookup and a corpus that knows half the answers, ragged
    trees in a batch of 4: equal to greedy AR token for token."""
    segments = [s for p, o in zip(prompts[:4], reference[:4])
                for s in answer_segments(p + o, [0] * len(p) + [1] * len(o))]
    corpus = CorpusIndex.from_segments(segments, target_fp32.vocab_size)
    drafter = _shipped_drafter(target_fp32, "fp32") if with_drafter else None
    dec = SpeculativeDecoder(target_fp32, drafter, lookup=LookupConfig(), corpus=corpus, tree=tree)
    out = dec.generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    assert [r.output_ids for r in out] == reference
    known = [n for r in out[:4] for n in r.stats.acceptance_lengths]
    assert sum(known) / len(known) > 3  # the corpus holds these answers
    assert sum(r.stats.corpus_cycles for r in out) > 0


def test_tree_accepts_at_least_the_chain(target_fp32, prompts, reference):
    """The chain's draft is one of the tree's branches, and the runner-up branches add
    acceptances: over the same (fp32-identical) outputs the tree needs fewer cycles."""
    drafter = _shipped_drafter(target_fp32, "fp32")
    chain = SpeculativeDecoder(target_fp32, drafter).generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    tree = SpeculativeDecoder(target_fp32, drafter, tree=TreeConfig()).generate(
        prompts, SamplingParams(MAX_NEW), batch_size=4)
    assert [r.output_ids for r in tree] == reference == [r.output_ids for r in chain]
    cycles = lambda out: sum(len(r.stats.acceptance_lengths) for r in out)  # noqa: E731
    assert cycles(tree) < cycles(chain)


def test_tree_decoding_bf16_emits_target_argmax(target_bf16, prompts):
    drafter = _shipped_drafter(target_bf16, "bf16")
    dec = SpeculativeDecoder(target_bf16, drafter, lookup=LookupConfig(), tree=TreeConfig())
    out = dec.generate(prompts, SamplingParams(MAX_NEW), batch_size=4)
    worst = max(float(_rescore_margins(target_bf16, p, r.output_ids).max()) for p, r in zip(prompts, out))
    assert worst <= BF16_MARGIN, f"an emitted token was {worst:.3f} logits below the target's argmax"
    assert max(n for r in out for n in r.stats.acceptance_lengths) > 2
