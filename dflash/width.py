"""How wide to verify: a measured cost model and each row's recent acceptance -> the width
of this cycle that maximises expected tokens per second, including width 1 (plain AR).

Speculation is a bet on the machine's cost curve. A width-W verify costs verify(b, W)
seconds at batch size b, a drafter pass drafter(b), a cycle's bookkeeping overhead(b); a
row whose guess from source s (the drafter, a context copy, a corpus chain) is accepted at
draft position k with probability a_k (given the drafts before it were) emits on average
    E(W) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_{min(W-1, L)}      (L: the guess's length)
tokens a cycle. `choose_width` takes the W (and whether to run the drafter at all) that
maximises sum_rows E / (verify(b, W) + drafter(b) [if run] + overhead(b)); with W = 1 no
guess is verified and the cycle is an AR step.

Every estimate is made from the past only (finished cycles and emitted tokens), never from
the target pass being decided, so the width changes speed, never the output.

The pieces:
  CostModel       seconds of each pass kind by (batch size, width): a start-up calibration,
                  then an EMA of the passes the decoder runs anyway; an unseen (b, W) is
                  estimated from the tokens it processes (b * W), scaled to what was seen at b.
  expected_tokens E(W) for every row, source and width, vectorised.
  choose_width    the pure decision (tested on tiny numbers).
  Acceptance      decayed per-position counts: one per row and source, with a decoder-wide
                  prior that new rows start from.
  Pending         guesses checked against the tokens emitted later (passive observation):
                  a copy found while the batch runs at W = 1 is still scored, so a row
                  stuck at W = 1 recovers; the drafter's block is scored past the verified
                  width the same way. The drafter itself is re-probed with exponential
                  back-off when no row has run it lately (WidthPolicy), and so is the
                  cost of going wide when the policy has stayed at W = 1 for a while.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash.masks import extend_attention_mask
from dflash.sampling import SamplingParams

SOURCES = ("drafter", "lookup", "corpus")
# a speculative cycle must promise this much more than an AR step (choose_width's margin):
# served on a CPU whose verify curve is steep, a margin of 0 chose cycles that lost
SPECULATION_MARGIN = 0.1


# --- the cost model ---------------------------------------------------------------------

def tokens_curve(points: list[tuple[float, float]], x: float) -> float:
    """Seconds of a pass over x tokens from measured (tokens, seconds) points sorted by
    tokens: made non-decreasing (a wider pass never costs less; the noise of a loaded machine
    does not say otherwise), piecewise-linear between them, and past the last one extended
    by the least-squares slope of all of them (>= 0); below the first, the first point.

    Example: points [(1, 10), (2, 14), (4, 12)] -> non-decreasing [10, 14, 14]; x = 3: 14;
    x = 8: 14 + 4 * slope, slope = least squares of (1, 10), (2, 14), (4, 14) = 1.14.
    """
    xs = [p[0] for p in points]
    ys = []
    for _, y in points:
        ys.append(max(y, ys[-1]) if ys else y)
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((a - mx) * (c - my) for a, c in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
        return ys[-1] + max(0.0, slope) * (x - xs[-1])
    i = next(i for i in range(1, len(xs)) if xs[i] >= x)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


@dataclass
class CostModel:
    """Seconds of a pass of `kind` ("verify", "drafter", "overhead") at batch size b and
    width w (the verify's tokens per row; 1 for the others), an EMA per (kind, b, w)."""

    alpha: float = 0.1  # EMA weight of a new observation (the first one sets the value)
    seen: dict = field(default_factory=dict)  # (kind, b, w) -> [seconds, observations]

    follow: float = 0.5  # how far a width's change moves the other widths seen at its (kind, b)
    passes: int = 0  # real observations so far (guesses not counted)
    last: dict = field(default_factory=dict)  # (kind, b, w) -> `passes` at its latest real observation

    def observe(self, kind: str, b: int, w: int, seconds: float, guess: bool = False) -> None:
        """Update the EMA of (kind, b, w). The machine's load moves every width at once, and
        a policy measures mostly the width it picks: the other widths seen at this (kind, b)
        follow the change by the factor (new / old) ** follow, so a rarely chosen width is
        not judged by a stale value from a busier (or quieter) moment. guess: a start-up
        calibration's timing, which the first pass of a real cycle replaces outright, scaling
        the calibration's other guesses at this (kind, b) by the same factor."""
        if guess:
            if self.seen.get((kind, b, w), [0, 0])[1] == 0:
                self.seen[(kind, b, w)] = [seconds, 0]
            return
        self.passes += 1
        self.last[(kind, b, w)] = self.passes
        entry = self.seen.setdefault((kind, b, w), [seconds, 0])
        if entry[1] == 0 and entry[0] > 0:  # a real pass replaces a guess: the other guesses of
            factor = seconds / entry[0]  # that calibration were timed under the same load
            for (k, bb, ww), other in self.seen.items():
                if k == kind and bb == b and ww != w and other[1] == 0:
                    other[0] *= factor
        entry[1] += 1
        a = max(self.alpha, 1.0 / entry[1])
        old = entry[0]
        entry[0] += a * (seconds - entry[0])
        if entry[1] > 1 and old > 0 and self.follow:
            factor = (entry[0] / old) ** self.follow
            for (k, bb, ww), other in self.seen.items():
                if k == kind and bb == b and ww != w:
                    other[0] *= factor

    def estimate(self, kind: str, b: int, w: int = 1) -> float | None:
        """The EMA where (kind, b, w) was seen (at least that of any narrower width seen at
        b); else `tokens_curve` over tokens processed
        (b * w) through every (b', w') seen, scaled by seen/curve at the nearest w' seen at
        this b. None when nothing of this kind was seen.

        Example: verify seen (1, 1) 10 ms, (1, 4) 16 ms, (2, 1) 12 ms. (2, 4) processes 8
        tokens: past the last point (4 tokens, 16 ms) by the slope 2 ms/token: 24 ms; at
        b = 2 the seen w = 1 (2 tokens, curve 12) measured 12, so the estimate stays 24 ms.
        """
        hit = self.seen.get((kind, b, w))
        if hit is not None:  # never below a narrower width seen at this b: noise, not a cheaper pass
            # (a measured pass is held to measured narrower ones only, not to calibration guesses)
            return max([hit[0]] + [s for (k, bb, ww), (s, n) in self.seen.items()
                                   if k == kind and bb == b and ww < w and (n > 0 or hit[1] == 0)])
        by_tokens: dict[int, list[float]] = {}
        for (k, bb, ww), (s, _) in self.seen.items():
            if k == kind:
                by_tokens.setdefault(bb * ww, []).append(s)
        if not by_tokens:
            return None
        points = sorted((n, sum(v) / len(v)) for n, v in by_tokens.items())
        guess = tokens_curve(points, b * w)
        same_b = [(abs(ww - w), ww, s) for (k, bb, ww), (s, _) in self.seen.items() if k == kind and bb == b]
        if same_b:
            _, ww, s = min(same_b)
            base = tokens_curve(points, b * ww)
            if base > 0:
                guess *= s / base
        return guess

    def staleness(self, kind: str, b: int, w: int) -> float:
        """Real observations of any pass since (kind, b, w)'s last one; inf if it has none."""
        seen = self.last.get((kind, b, w))
        return float("inf") if seen is None else self.passes - seen

    def curve(self, b: int, widths: range) -> dict[int, float]:
        """verify(b, W) / verify(b, 1) for each W: a verify's cost in one-token steps."""
        one = self.estimate("verify", b, 1)
        return {w: round(self.estimate("verify", b, w) / one, 3) for w in widths} if one else {}


# --- expected tokens and the decision -----------------------------------------------------

def expected_tokens(rates: torch.Tensor, lengths: torch.Tensor, max_width: int) -> torch.Tensor:
    """rates (..., K) acceptance at draft positions 1..K; lengths (...) the guess's own
    drafts -> (..., max_width): E at W = 1..max_width, counting drafts 1..min(W-1, length).

    Example: rates [0.5, 0.5, 0.5], length 2, max_width 4 -> [1, 1.5, 1.75, 1.75].
    """
    K = rates.shape[-1]
    reach = torch.cumprod(rates, -1) * (torch.arange(K) < lengths[..., None])  # P(d_1..d_k accepted)
    gain = torch.cat([torch.zeros_like(reach[..., :1]), reach], -1).cumsum(-1)  # (..., K+1): E(W) - 1, W = 1..K+1
    if K + 1 < max_width:
        gain = torch.cat([gain, gain[..., -1:].expand(*gain.shape[:-1], max_width - K - 1)], -1)
    return 1 + gain[..., :max_width]


@dataclass(frozen=True)
class Plan:
    """One cycle's decision: the verify width, whether the drafter runs, each row's source
    (an index into SOURCES, or -1 for no guess) and its own drafts (<= width - 1)."""

    width: int
    drafter: bool
    sources: list[int]
    lengths: list[int]
    rate: float = 0.0  # the expected tokens per second this plan was chosen for


def choose_width(gain: torch.Tensor, available: torch.Tensor, lengths: torch.Tensor, verify_s: list[float],
                 drafter_s: float | None, overhead_s: float, margin: float = 0.0) -> Plan:
    """gain (b, S, max_width) expected tokens per row, source (SOURCES order) and width
    (expected_tokens); available (b, S) which copy sources have a guess (source 0, the
    drafter, has one for every row when it runs; drafter_s None: no drafter); lengths (b, S)
    each guess's drafts; verify_s[W-1] the seconds of a width-W verify at this batch size.
    -> the Plan of highest sum(E) / (verify + drafter if run + overhead), where a plan that
    speculates (W > 1 or the drafter run) must beat plain AR (W = 1) by the factor 1 + margin:
    its rate is an estimate, and the best of several noisy estimates is biased upward.

    Example (one row, the drafter only, max_width 3): gain [[1, 1.8, 2.2]], verify
    [10, 11, 13] ms, drafter 2 ms, overhead 0 -> 0.1, 0.138, 0.147 tokens/ms: W = 3 with
    the drafter. With gain [[1, 1.1, 1.15]] the same costs give W = 1 (0.1 > 0.085).
    """
    b, S, max_width = gain.shape
    best = None
    for run in ((False, True) if drafter_s is not None else (False,)):
        usable = available.clone()
        usable[:, 0] = run
        g = torch.where(usable[..., None], gain, torch.ones_like(gain))  # no guess: one token
        row_best, src = g.max(1)  # (b, max_width)
        for w in range(2 if run else 1, max_width + 1):
            seconds = verify_s[w - 1] + (drafter_s if run else 0.0) + overhead_s
            rate = float(row_best[:, w - 1].sum()) / max(seconds, 1e-12)
            score = rate if w == 1 and not run else rate / (1 + margin)
            if best is None or score > best[0] * (1 + 1e-9):
                best = (score, rate, w, run, src[:, w - 1], usable)
    _, rate, w, run, src, usable = best
    sources = [int(s) if w > 1 and bool(usable[i, int(s)]) else -1 for i, s in enumerate(src.tolist())]
    own = [0 if s < 0 else min(w - 1, int(lengths[i, s])) for i, s in enumerate(sources)]
    return Plan(w, run, sources, own, rate)


# --- acceptance: decayed counts per row and source, and the decoder-wide prior ------------

class Acceptance:
    """Per source, decayed counts of drafts tried and accepted at positions 1..K.
    rates(prior, strength): (accepted + strength * prior) / (tried + strength)."""

    def __init__(self, positions: int, decay: float):
        self.decay = decay
        self.tried = torch.zeros(len(SOURCES), positions)
        self.accepted = torch.zeros(len(SOURCES), positions)

    def observe(self, source: int, hits: int, tried: int) -> None:
        """A guess from `source` whose first `hits` drafts were right, of `tried` scored
        (tried = hits + 1 at a miss, = hits when every scored draft was right)."""
        self.tried[source] *= self.decay
        self.accepted[source] *= self.decay
        self.tried[source, :tried] += 1
        self.accepted[source, :hits] += 1

    def rates(self, prior: torch.Tensor, strength: float) -> torch.Tensor:
        return (self.accepted + strength * prior) / (self.tried + strength)


@dataclass
class Pending:
    """A guess waiting for the tokens it guessed: drafts[j] guesses output index start + j."""

    source: int
    drafts: list[int]
    start: int

    def score(self, output: list[int]) -> tuple[int, int] | None:
        """(hits, tried) once decided (a miss, or every draft compared), else None.

        Example: drafts [5, 6, 7] from start 10; output[10:] = [5, 6] -> None (undecided);
        [5, 9] -> (1, 2); [5, 6, 7, 1] -> (3, 3)."""
        seen = output[self.start: self.start + len(self.drafts)]
        for j, tok in enumerate(seen):
            if tok != self.drafts[j]:
                return j, j + 1
        return (len(seen), len(seen)) if len(seen) == len(self.drafts) else None


@dataclass
class RowWidth:
    """A request's width state: its acceptance by source and its pending guesses."""

    acceptance: Acceptance
    pending: dict = field(default_factory=dict)  # source -> Pending
    since_drafter: int = 0  # cycles since the drafter last drafted for this row


class WidthPolicy:
    """The decoder's width policy: one CostModel, a decoder-wide acceptance prior per
    source and position, and each row's RowWidth (kept on its Request)."""

    def __init__(self, max_width: int, costs: CostModel | None = None, prior: float = 0.5, strength: float = 4.0,
                 row_decay: float = 0.9, global_decay: float = 0.995, probe_gap: int = 4, max_probe_gap: int = 64,
                 margin: float = SPECULATION_MARGIN, cost_probe_gap: int = 16, max_cost_probe_gap: int = 256):
        self.max_width = max_width
        self.margin = margin
        # when the policy stays at W = 1 and the best wider plan's verify cost was last measured
        # more than cost_probe_gap passes ago (or never), that plan runs once anyway (at most
        # once per cost_probe_gap cycles), so its cost is measured again: a verify timed in a
        # busy moment (a calibration during another job) would otherwise keep every later
        # cycle at W = 1. The gap doubles per probe
        self.cost_probe_gap, self.max_cost_probe_gap = cost_probe_gap, max_cost_probe_gap
        self.since_cost_probe = 0  # cycles since the last such probe (at most one per gap)
        self.positions = max(1, max_width - 1)
        self.costs = costs or CostModel()
        self.strength = strength
        self.row_decay = row_decay
        self.initial_prior = prior  # optimistic: a new decoder tries to speculate, then learns
        self.overall = Acceptance(self.positions, global_decay)
        self.probe_gap, self.min_probe_gap, self.max_probe_gap = probe_gap, probe_gap, max_probe_gap
        self.widths: dict[int, int] = {}  # chosen width -> cycles

    def new_row(self) -> RowWidth:
        return RowWidth(Acceptance(self.positions, self.row_decay))

    def prior(self) -> torch.Tensor:
        return self.overall.rates(torch.full((len(SOURCES), self.positions), self.initial_prior), self.strength)

    def plan(self, rows: list[RowWidth], guesses: list[dict[int, list[int]]], drafter_block: int | None) -> Plan:
        """This cycle's plan for rows with their copy guesses ({source: drafts}); drafter_block:
        the drafter's block (None without a drafter)."""
        b, S = len(rows), len(SOURCES)
        prior = self.prior()
        rates = torch.stack([r.acceptance.rates(prior, self.strength) for r in rows])  # (b, S, K)
        lengths = torch.zeros(b, S, dtype=torch.long)
        available = torch.zeros(b, S, dtype=torch.bool)
        for i, g in enumerate(guesses):
            for s, drafts in g.items():
                lengths[i, s], available[i, s] = len(drafts), True
        if drafter_block:
            lengths[:, 0] = drafter_block - 1
        gain = expected_tokens(rates, lengths, self.max_width)  # (b, S, max_width)
        verify = [self._cost("verify", b, w) for w in range(1, self.max_width + 1)]
        drafter_s = self._cost("drafter", b, 1) if drafter_block else None
        overhead = self.costs.estimate("overhead", b, 1) or 0.0
        plan = choose_width(gain, available, lengths, verify, drafter_s, overhead, self.margin)
        self.since_cost_probe += 1
        probe = None
        if plan.width == 1 and self.since_cost_probe >= self.cost_probe_gap:
            wide = choose_width(gain, available, lengths, [float("inf")] + verify[1:], drafter_s, overhead)
            if (wide.width > 1 and any(src >= 0 for src in wide.sources)
                    and self.costs.staleness("verify", b, wide.width) >= self.cost_probe_gap):
                probe = wide
                self.cost_probe_gap = min(2 * self.cost_probe_gap, self.max_cost_probe_gap)
                self.since_cost_probe = 0
        if probe is not None:  # probe the cost of going wide
            plan = probe
        elif drafter_block and not plan.drafter:
            if max(r.since_drafter for r in rows) >= self.probe_gap:  # probe: draft for passive scoring
                plan = Plan(plan.width, True, plan.sources, plan.lengths, plan.rate)
                self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
        elif plan.drafter and plan.width > 1 and any(s == 0 for s in plan.sources):
            self.probe_gap = self.min_probe_gap  # the drafter pays again: probe soon after it stops
        self.widths[plan.width] = self.widths.get(plan.width, 0) + 1
        return plan

    def _cost(self, kind: str, b: int, w: int) -> float:
        s = self.costs.estimate(kind, b, w)
        return s if s is not None else float(b * w)  # uncalibrated: tokens processed

    def propose(self, row: RowWidth, source: int, drafts: list[int], start: int) -> None:
        """Keep a guess to score against the tokens emitted later (one pending per source)."""
        if drafts and source not in row.pending:
            row.pending[source] = Pending(source, list(drafts), start)

    def score(self, row: RowWidth, output: list[int], finished: bool = False) -> None:
        """Score the row's pending guesses decided by its output so far (all of them, on
        the part already emitted, when it finished)."""
        for source, p in list(row.pending.items()):
            result = p.score(output)
            if result is None and finished:
                seen = len(output) - p.start
                result = (seen, seen) if seen > 0 else None
                if result is None:
                    del row.pending[source]
                    continue
            if result is not None:
                hits, tried = result
                row.acceptance.observe(source, hits, tried)
                self.overall.observe(source, hits, tried)
                del row.pending[source]


# --- the start-up calibration ------------------------------------------------------------

@torch.no_grad()
def calibrate(dec, budget_s: float, context: int = 128) -> dict[int, float]:
    """Time a width-W verify (W = 1 .. max_width, as many as the budget allows, the ends
    first) and a drafter pass at batch 1 over a `context`-token cache into the cost model
    of `dec` (a dflash.decoding.SpeculativeDecoder, passed in: the decoder calls this at
    start-up): the guess the passes of real cycles then refine.
    Returns {W: verify seconds}."""
    costs = dec.policy.costs
    n = min(context, max(1, dec.max_positions - dec.max_width - 2))
    ids = [(7 * k) % max(2, dec.target.vocab_size - 1) + 1 for k in range(n)]
    batch = dec.prefill([ids], SamplingParams(max_new_tokens=1))
    taps = dec.tap_ids if dec.drafter is not None else None

    def verify(w: int) -> float:
        ids_w = batch.anchor[:, None].repeat(1, w)
        pos = batch.next_pos[:, None] + torch.arange(w, device=dec.device)
        dec._sync()
        t = time.perf_counter()
        dec.target.forward(ids_w, pos, extend_attention_mask(batch.slot_valid, w, causal=True), batch.cache,
                           tap_layer_ids=taps)
        dec._sync()
        dt = time.perf_counter() - t
        batch.cache.crop(-w)
        return dt

    order = [1, dec.max_width] + sorted({2, 4, 8, 3, 6, 12, 16} - {1, dec.max_width},
                                        key=lambda w: (w not in (2, 4, 8), w))
    order = [w for w in dict.fromkeys(order) if w <= dec.max_width]
    verify(1), verify(dec.max_width)  # warm-up
    t0 = time.perf_counter()
    seen = {}
    for w in order:
        if len(seen) >= 2 and time.perf_counter() - t0 > budget_s:
            break
        seen[w] = min(verify(w), verify(w))
        costs.observe("verify", 1, w, seen[w], guess=True)
    if dec.drafter is not None:
        dec.draft_scores(batch)
        t = time.perf_counter()
        dec.draft_scores(batch)
        dec._sync()
        costs.observe("drafter", 1, 1, time.perf_counter() - t, guess=True)
    return seen
