"""Batch state and cache surgery (dflash.batch) on tiny tensors, against loop references.

The K/V of slot s in row i is filled with the number 10*i + s, so after any surgery each
slot says where it came from."""

import torch
from transformers import DynamicCache

from dflash.batch import DecodeBatch, Request, RequestStats, compact, compaction_order, merge, select_rows
from dflash.sampling import SamplingParams


def _batch(slot_valid: list[list[int]], context: bool = True) -> DecodeBatch:
    """Rows of S slots; one target layer and one context layer, heads 2, head_dim 1."""
    valid = torch.tensor(slot_valid, dtype=torch.bool)
    b, s = valid.shape
    kv = (10 * torch.arange(b)[:, None] + torch.arange(s)[None]).float()[:, None, :, None].expand(b, 2, s, 1)
    cache = DynamicCache()
    cache.update(kv.clone(), -kv.clone(), 0)
    requests = [Request([1], SamplingParams(4), RequestStats(4), torch.Generator()) for _ in range(b)]
    return DecodeBatch(requests, cache, [(kv.clone(), -kv.clone())] if context else None, valid,
                       valid.sum(1), torch.zeros(b, dtype=torch.long))


def _slots(batch: DecodeBatch) -> list[list[float]]:
    """The origin (10*row + slot) of every slot, from the target keys; both caches checked equal."""
    keys = batch.cache.layers[0].keys
    assert torch.equal(batch.cache.layers[0].values, -keys)
    if batch.context is not None:
        assert torch.equal(batch.context[0][0], keys) and torch.equal(batch.context[0][1], -keys)
    return keys[:, 0, :, 0].tolist()


def test_compaction_order_of_the_docstring_example():
    valid = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    order = compaction_order(valid)
    assert order.tolist() == [[0, 2, 3], [3, 2, 4]]
    assert valid.gather(1, order).int().tolist() == [[1, 1, 1], [0, 1, 1]]


def test_compact_keeps_every_valid_slot_in_order():
    """Loop reference: each row's valid slots, in order, right-aligned."""
    g = torch.Generator().manual_seed(0)
    valid = (torch.rand(5, 9, generator=g) < 0.5).tolist()
    valid[0] = [True] * 6 + [False] * 3  # the widest row
    batch = _batch(valid)
    before = _slots(batch)
    batch = compact(batch)
    width = max(sum(row) for row in valid)
    assert batch.num_slots == width
    for i, row in enumerate(valid):
        kept = [v for v, ok in zip(before[i], row) if ok]
        got = [v for v, ok in zip(_slots(batch)[i], batch.slot_valid[i].tolist()) if ok]
        assert got == kept and _slots(batch)[i][width - len(kept):] == kept


def test_compact_without_holes_changes_nothing():
    batch = _batch([[1, 1], [0, 1]])
    assert compact(batch) is batch and batch.num_slots == 2


def test_select_rows_and_merge():
    a = _batch([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    kept = select_rows(a, [2, 0])
    assert _slots(kept) == [[20, 21, 22], [0, 1, 2]]
    assert kept.slot_valid.int().tolist() == [[1, 0, 1], [1, 1, 0]] and kept.requests == [a.requests[2], a.requests[0]]
    b = _batch([[1]])
    joined = merge(kept, b)  # b is left-padded to 3 slots with holes
    assert len(joined) == 3 and joined.num_slots == 3
    assert joined.slot_valid.int().tolist() == [[1, 0, 1], [1, 1, 0], [0, 0, 1]]
    assert _slots(joined)[2][2] == 0 and joined.next_pos.tolist() == [2, 2, 1]


def test_stats_histogram_spans_the_widest_verify():
    stats = RequestStats(max_width=4, acceptance_lengths=[1, 4, 2, 4])
    assert stats.histogram() == [1, 1, 0, 2] and stats.tau == 2.75
    assert "max_width" not in stats.to_dict() and stats.to_dict()["acceptance_histogram"] == [1, 1, 0, 2]


def test_stats_record_counts_scored_and_accepted_drafts_by_position():
    stats = RequestStats(max_width=5)
    stats.record(5, "drafter", own=4, num_accepted=2)  # d1, d2 accepted, d3 rejected, d4 never reached
    stats.record(3, "lookup", own=2, num_accepted=2)  # both accepted
    stats.record(1, None, own=0, num_accepted=0)  # an AR step
    assert stats.tried == {"drafter": [1, 1, 1, 0], "lookup": [1, 1, 0, 0]}
    assert stats.accepted == {"drafter": [1, 1, 0, 0], "lookup": [1, 1, 0, 0]}
    assert stats.verify_widths == [5, 3, 1] and stats.acceptance_lengths == [3, 3, 1] and stats.lookup_cycles == 1
    assert stats.to_dict()["mean_verify_width"] == 3.0


def test_position_uniforms_do_not_depend_on_how_they_are_read():
    """uniforms_at(k) is the k-th output token's uniform however many a cycle reads."""
    def request():
        return Request([1], SamplingParams(4), RequestStats(4), torch.Generator().manual_seed(5))

    a, b = request(), request()
    whole = a.uniforms_at(0, 70)
    pieces = b.uniforms_at(0, 1) + b.uniforms_at(1, 3) + b.uniforms_at(4, 40) + b.uniforms_at(44, 26)
    assert whole == pieces and len(set(whole)) == 70
    assert b.uniforms_at(10, 2) == whole[10:12]  # re-reading a position gives the same draw
