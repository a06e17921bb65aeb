"""Adaptive width (dflash.width): the pure pieces on tiny numbers, then the policy's choices."""

import pytest
import torch

from dflash.width import (Acceptance, CostModel, Pending, WidthPolicy, choose_width, expected_tokens,
                          tokens_curve)


def test_tokens_curve_of_the_docstring_example():
    points = [(1, 10.0), (2, 14.0), (4, 12.0)]  # noise: the 4-token pass measured cheaper
    assert tokens_curve(points, 3) == 14.0  # made non-decreasing
    assert tokens_curve(points, 8) == pytest.approx(14 + 4 * 8 / 7)  # least-squares slope 8/7
    assert tokens_curve(points, 0.5) == 10.0
    assert tokens_curve([(2, 6.0)], 4) == 12.0  # one point: proportional


def test_cost_model_ema_and_unseen_estimates():
    c = CostModel(alpha=0.5)
    c.observe("verify", 1, 1, 0.010)
    c.observe("verify", 1, 4, 0.016)
    c.observe("verify", 2, 1, 0.012)
    assert c.estimate("verify", 1, 1) == 0.010
    assert c.estimate("verify", 2, 4) == pytest.approx(0.024)  # the docstring example
    assert c.estimate("verify", 1, 2) == pytest.approx(0.012)  # between 1 and 4 tokens
    c.observe("verify", 1, 1, 0.020)  # EMA: half way
    assert c.estimate("verify", 1, 1) == pytest.approx(0.015)
    assert c.estimate("drafter", 1, 1) is None
    assert c.curve(1, range(1, 3)) == {1: 1.0, 2: 1.0}  # (2, 1) at 12 ms cannot make 2 tokens cheaper
    # past the points by their least-squares slope (25 ms/token over 1, 2, 3 tokens)
    c2 = CostModel()
    c2.observe("verify", 1, 1, 0.010)
    c2.observe("verify", 1, 2, 0.020)
    c2.observe("verify", 3, 1, 0.060)
    assert c2.estimate("verify", 3, 2) == pytest.approx(0.060 + 3 * 0.025)
    # scaled by what was seen at this batch size (1.2x the curve at b = 2)
    c3 = CostModel()
    c3.observe("verify", 1, 1, 0.010)
    c3.observe("verify", 1, 4, 0.040)
    c3.observe("verify", 2, 2, 0.060)  # 4 tokens: the same curve point averages 0.05
    assert c3.estimate("verify", 2, 1) == pytest.approx((0.010 + 0.040 / 3) * 0.060 / 0.050)


def test_expected_tokens_of_the_docstring_example():
    e = expected_tokens(torch.tensor([0.5, 0.5, 0.5]), torch.tensor(2), 4)
    assert e.tolist() == [1.0, 1.5, 1.75, 1.75]
    e = expected_tokens(torch.tensor([[1.0, 0.0]]), torch.tensor([5]), 5)  # past K: flat
    assert e.tolist() == [[1.0, 2.0, 2.0, 2.0, 2.0]]


def test_choose_width_of_the_docstring_example():
    def one_row(gain):
        g = torch.ones(1, 3, 3)
        g[0, 0] = torch.tensor(gain)
        return g

    none = torch.zeros(1, 3, dtype=torch.bool)
    lengths = torch.tensor([[2, 0, 0]])
    plan = choose_width(one_row([1, 1.8, 2.2]), none, lengths, [10, 11, 13], 2, 0)
    assert (plan.width, plan.drafter, plan.sources, plan.lengths) == (3, True, [0], [2])
    assert plan.rate == pytest.approx(2.2 / 15)
    plan = choose_width(one_row([1, 1.1, 1.15]), none, lengths, [10, 11, 13], 2, 0)
    assert (plan.width, plan.drafter, plan.sources, plan.lengths) == (1, False, [-1], [0])
    # a speculative plan must beat AR by the margin: 0.147 < 1.5 * 0.1, but > 1.4 * 0.1
    plan = choose_width(one_row([1, 1.8, 2.2]), none, lengths, [10, 11, 13], 2, 0, margin=0.5)
    assert (plan.width, plan.drafter, plan.rate) == (1, False, pytest.approx(0.1))
    plan = choose_width(one_row([1, 1.8, 2.2]), none, lengths, [10, 11, 13], 2, 0, margin=0.4)
    assert (plan.width, plan.drafter, plan.rate) == (3, True, pytest.approx(2.2 / 15))


def test_choose_width_takes_a_copy_without_the_drafter_pass():
    """Row 0 has a good context copy, row 1 nothing: W = 3 with no drafter pass beats W = 1
    and the drafter's plan (which pays a pass for row 1's weak drafts)."""
    gain = torch.ones(2, 3, 3)
    gain[0, 1] = torch.tensor([1, 1.9, 2.7])  # the copy
    gain[:, 0] = torch.tensor([1, 1.2, 1.3])  # the drafter, both rows
    available = torch.tensor([[False, True, False], [False, False, False]])
    lengths = torch.tensor([[2, 4, 0], [2, 0, 0]])
    plan = choose_width(gain, available, lengths, [10, 10.5, 11], 4, 1)
    assert (plan.width, plan.drafter, plan.sources, plan.lengths) == (3, False, [1, -1], [2, 0])
    plan = choose_width(gain, available, lengths, [10, 10.5, 11], None, 1)  # no drafter at all
    assert plan.sources == [1, -1]


def test_acceptance_and_pending_scores():
    p = Pending(source=1, drafts=[5, 6, 7], start=10)
    out = list(range(10))
    assert p.score(out + [5, 6]) is None
    assert p.score(out + [5, 9]) == (1, 2)
    assert p.score(out + [5, 6, 7, 1]) == (3, 3)
    a = Acceptance(positions=3, decay=0.5)
    a.observe(0, hits=1, tried=2)
    assert a.tried[0].tolist() == [1, 1, 0] and a.accepted[0].tolist() == [1, 0, 0]
    a.observe(0, hits=0, tried=1)  # earlier counts halve first
    assert a.tried[0].tolist() == [1.5, 0.5, 0] and a.accepted[0].tolist() == [0.5, 0, 0]
    rates = a.rates(torch.full((3, 3), 0.5), strength=1.0)
    assert rates[0].tolist() == pytest.approx([1 / 2.5, 0.5 / 1.5, 0.5])


def _costly_policy(max_width=4, verify_ratio=(1.0, 1.1, 1.2, 1.3), **kw):
    """kw: WidthPolicy's; by default no cost probes (their own test turns them on)."""
    costs = CostModel()
    for w, r in enumerate(verify_ratio, 1):
        costs.observe("verify", 1, w, 0.030 * r)
    costs.observe("drafter", 1, 1, 0.006)
    return WidthPolicy(max_width, costs, **({"cost_probe_gap": 10 ** 9} | kw))


def test_policy_stops_drafting_a_row_that_misses_then_probes_with_back_off():
    policy = _costly_policy(verify_ratio=(1.0, 2.0, 2.5, 3.0))  # a machine where verify costs
    row = policy.new_row()
    out = [0]
    drafted = []
    for step in range(100):
        plan = policy.plan([row], [{}], drafter_block=4)
        drafted.append(plan.drafter)
        if plan.drafter:  # the drafter always misses: guesses 99s
            policy.propose(row, 0, [99, 99, 99], len(out))
            row.since_drafter = 0
        else:
            row.since_drafter += 1
        out.append(step + 1)
        policy.score(row, out)
    assert plan.width == 1 and drafted[-1] is False
    probes = [i for i, d in enumerate(drafted) if d]  # drafter passes for passive scoring only
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) >= 2 and gaps == sorted(gaps) and gaps[-1] > 1.5 * gaps[0], probes  # exponential back-off


def test_policy_goes_wide_on_good_copies_and_recovers_from_width_one():
    """A row stuck at W = 1 (its copies missed) keeps scoring copies passively; when they
    start to match, the policy widens again without any probe."""
    policy = _costly_policy(verify_ratio=(1.0, 1.05, 1.1, 1.15))
    row = policy.new_row()
    out = [0]
    widths = []
    for step in range(40):
        good = step >= 20
        nxt = [step + 1, step + 2, step + 3]
        guess = nxt if good else [77, 77, 77]
        plan = policy.plan([row], [{1: guess}], drafter_block=None)
        widths.append(plan.width)
        policy.propose(row, 1, guess, len(out))
        out.append(step + 1)
        policy.score(row, out)
    assert widths[15:20] == [1] * 5 and widths[-1] == 4, widths


def test_a_verify_cost_measured_in_a_busy_moment_is_measured_again():
    """Calibrated while another job ran, W >= 2 looks 20x dearer than it is. The policy would
    stay at W = 1, but a cost never measured by a real pass is stale: the best wider plan runs
    once, its real cost replaces the guesses, and the policy goes wide on merit. Where going
    wide truly costs that much, the probes back off exponentially."""
    def run(true_ratio, steps):
        costs = CostModel()
        for w in range(1, 5):  # the busy calibration: guesses, as `calibrate` records them
            costs.observe("verify", 1, w, 0.030 * (1.0 if w == 1 else 20.0), guess=True)
        policy = WidthPolicy(4, costs, cost_probe_gap=4, max_cost_probe_gap=32)
        row, out, widths = policy.new_row(), [0], []
        for step in range(steps):
            nxt = [step + 1, step + 2, step + 3]  # copies that always match
            plan = policy.plan([row], [{1: nxt}], drafter_block=None)
            widths.append(plan.width)
            policy.costs.observe("verify", 1, plan.width, 0.030 * (1.0 if plan.width == 1 else true_ratio))
            policy.propose(row, 1, nxt, len(out))
            out.append(step + 1)
            policy.score(row, out)
        return widths

    cheap = run(1.1, 20)
    assert cheap[:3] == [1, 1, 1] and cheap[3] > 1 and cheap[-5:] == [4] * 5, cheap
    dear = run(20.0, 80)
    probes = [i for i, w in enumerate(dear) if w > 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 3 and len(probes) >= 4 and gaps == sorted(gaps) and gaps[-1] >= 3 * gaps[0], dear
    assert len(probes) <= 5  # in 80 cycles: gaps of about 4, 8, 16, then 32 (the cap)


def test_cost_model_follows_the_load_and_never_makes_a_wider_pass_cheaper():
    c = CostModel(alpha=0.5, follow=0.5)
    for w, s in ((1, 0.010), (4, 0.012), (8, 0.014)):
        c.observe("verify", 1, w, s)
    c.observe("verify", 1, 4, 0.036)  # the machine got busy: EMA 0.024, twice the old value
    assert c.estimate("verify", 1, 4) == pytest.approx(0.024)
    assert c.estimate("verify", 1, 1) == pytest.approx(0.010 * 2 ** 0.5)  # the others follow part way
    assert c.estimate("verify", 1, 8) == pytest.approx(max(0.014 * 2 ** 0.5, 0.024))  # >= the narrower 4
    c2 = CostModel()
    c2.observe("verify", 1, 1, 0.020)
    c2.observe("verify", 1, 7, 0.015)  # measured cheaper than one token: noise
    assert c2.estimate("verify", 1, 7) == 0.020
    # calibration timings are guesses: the first real pass replaces one and rescales the
    # others of its (kind, b) by the same factor; later passes average as usual
    c3 = CostModel(alpha=0.5)
    for w, sec in ((2, 0.20), (4, 0.40)):
        c3.observe("verify", 1, w, sec, guess=True)
    c3.observe("verify", 1, 4, 0.04)
    assert c3.estimate("verify", 1, 4) == pytest.approx(0.04) and c3.estimate("verify", 1, 2) == pytest.approx(0.02)
    c3.observe("verify", 1, 4, 0.08)
    assert c3.estimate("verify", 1, 4) == pytest.approx(0.06)
    c3.observe("verify", 1, 4, 1.0, guess=True)  # a guess never overrides a measurement
    assert c3.estimate("verify", 1, 4) == pytest.approx(0.06)
