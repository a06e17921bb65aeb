"""Speculative decoding with a DFlash drafter, batched, with ragged acceptance per sequence.

One cycle for every in-flight sequence (block size B):
  1. draft   the drafter denoises [anchor, MASK x (B-1)] in one pass over its context
             (the fused target features of every verified token before the anchor);
  2. verify  the target scores [anchor, d_1 .. d_{B-1}] in one pass;
  3. accept  the longest agreeing prefix plus one bonus token from the target
             (dflash.sampling: greedy, "match" or "rejection" rule);
  4. commit  keep the anchor and accepted drafts in both caches, drop the rest; the
             bonus token becomes the next anchor.
Plain autoregressive decoding is the same loop with no drafter (B = 1: verify the anchor,
emit the bonus), so the baseline shares every line of bookkeeping. With context lookup
(dflash.lookup), a sequence whose last tokens occurred earlier drafts a copy of what
followed them instead of step 1's block; failing that, with a corpus (dflash.corpus), the
continuation the target most often wrote after its last tokens. Such a cycle verifies the
widest of the drafts (W tokens, at most max_width), each row only its own. With a
TreeConfig, a cycle instead verifies all of these guesses at once as a token tree and
keeps the longest path of the target's own tokens (dflash.tree).

Width. By default (adaptive) each cycle first plans its verify width W (dflash.width): the
W in 1..max_width, and whether the drafter runs at all, that maximise the batch's expected
tokens per second under the measured pass costs (a start-up calibration, then the passes
run) and each row's recent acceptance by source and position; each row verifies the guess
it expects most from, W = 1 being a plain AR step. Pinned (`adaptive=False`, --block-size),
every row verifies its whole guess each cycle. The plan reads only the past.

Randomness. Greedy rows need none. A sampled row draws its target tokens with the uniforms
of their output positions (Request.uniforms_at), so under the match rule its text is AR
sampling's with the same seed whatever was drafted; seeded rows always verify that way,
which is what makes a seeded request decode the same text alone, in any batch, at any
width. Unseeded sampled rows verify by the decoder's rule (rejection by default: it accepts
more), drawing their draft samples and acceptance tests from their own generator.
Prefill can run in chunks (Prefill), for a server to interleave with decode steps.

The batch state and its cache layout (slots, holes, compaction) live in dflash.batch.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator

import torch

from dflash.batch import DecodeBatch, Request, compact, select_rows
from dflash.config import check_drafter_fits
from dflash.corpus import ORDERS as CORPUS_ORDERS
from dflash.corpus import CorpusIndex
from dflash.drafter import DFlashDrafter, OutputHead, concat_context
from dflash.lookup import LookupConfig
from dflash.masks import extend_attention_mask
from dflash.prefill import Prefill
from dflash.sampling import (VERIFY_RULES, SamplingParams, greedy_tokens, row_uniforms, sample_from, target_tokens,
                             token_probs, verify_match, verify_rejection)
from dflash.target import Target
from dflash.tree import DraftTree, TreeConfig, build_tree
from dflash.width import SOURCES, SPECULATION_MARGIN, CostModel, Plan, WidthPolicy, calibrate

DRAFTER, LOOKUP, CORPUS = range(3)  # indices into dflash.width.SOURCES
# one cost model per loaded target: every decoder on it (AR, DFlash, a bench's ablation)
# measures and reads the same machine
_COSTS: "weakref.WeakKeyDictionary[Target, CostModel]" = weakref.WeakKeyDictionary()
CALIBRATION_S = 1.5  # the start-up calibration's time budget



class SpeculativeDecoder:
    """Target (+ optional DFlash drafter, + optional context lookup) -> batched lossless decoding.

    verify: "rejection" (default; accepts more at T > 0) or "match"; greedy requests are
    exact under either. block_size defaults to the drafter's decode_block_size (its training
    block size unless its config says otherwise); 1 without a drafter. lookup: a sequence
    whose last tokens occurred earlier drafts lookup.num_tokens copied tokens instead
    (dflash.lookup); corpus: else a sequence whose last tokens the corpus knows drafts their
    chained continuations (dflash.corpus). A cycle verifies the batch's longest draft (at
    most max_width tokens), and each row accepts only from its own. tree: verify a draft tree of every guess
    instead (dflash.tree; at T > 0 its walk is the match rule, whatever `verify` says). adaptive (default):
    choose each cycle's width from measured costs and acceptance (dflash.width, module docstring), a
    speculative one only when it promises speculation_margin more than an AR step; False: every row
    verifies its whole guess (the width pinned by block_size).
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None,
                 verify: str = "rejection", block_size: int | None = None, lookup: LookupConfig | None = None,
                 corpus: CorpusIndex | None = None, tree: TreeConfig | None = None, adaptive: bool = True,
                 speculation_margin: float = SPECULATION_MARGIN):
        if verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
        self.target = target
        self.drafter = drafter.eval().requires_grad_(False) if drafter is not None else None
        self.verify = verify
        self.lookup = lookup
        if corpus is not None and corpus.vocab_size != target.vocab_size:
            raise ValueError(f"corpus made for a vocabulary of {corpus.vocab_size}, target has {target.vocab_size}")
        self.corpus = corpus
        self.tree = tree
        if drafter is None:
            self.block_size = 1
        else:
            cfg = drafter.config
            check_drafter_fits(cfg, target)
            self.block_size = block_size or cfg.decode_block_size or cfg.block_size
            if self.block_size < 2:
                raise ValueError("a drafter needs block_size >= 2")
            self.tap_ids = cfg.target_layer_ids
            self.mask_token_id = cfg.mask_token_id
            self.head = OutputHead(target.model.lm_head.weight, drafter.draft_vocab)
        self.max_width = max(self.block_size, lookup.num_tokens + 1 if lookup else 1,
                             corpus.num_tokens + 1 if corpus else 1)  # tokens per verify
        self.stop_token_ids = set(target.stop_token_ids)
        self.max_positions = getattr(target.config, "max_position_embeddings", 1 << 30)
        # adaptive width (dflash.width): each cycle verifies the width the measured costs and
        # the rows' acceptance say pays best, 1 (an AR step) included; else every cycle
        # verifies each row's whole guess (the "pinned" width of --block-size)
        guesses = drafter is not None or lookup is not None or corpus is not None
        self.policy = None
        if adaptive and guesses and tree is None:
            costs = _COSTS.setdefault(target, CostModel())
            self.policy = WidthPolicy(self.max_width, costs, margin=speculation_margin)
            if not any(kind == "verify" and b == 1 for kind, b, _ in costs.seen):
                self.calibrate()

    @property
    def device(self) -> torch.device:
        return self.target.device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stops(self, params: SamplingParams) -> set[int]:
        """The tokens that end a request: the target's and its own, or only its own with ignore_eos."""
        own = set(params.stop_token_ids)
        return own if params.ignore_eos else self.stop_token_ids | own

    def _position_uniforms(self, batch: DecodeBatch, width: int, rows=None) -> torch.Tensor:
        """(b, width): row i's uniforms for its next `width` output indices (Request.uniforms_at),
        zeros for greedy rows and rows not in `rows` (a set of indices)."""
        u = torch.zeros(len(batch), width)
        for i, r in enumerate(batch.requests):
            if r.params.temperature > 0 and (rows is None or i in rows):
                u[i] = torch.tensor(r.uniforms_at(len(r.output_ids), width))
        return u.to(self.device)

    def _rejects(self, r: Request) -> bool:
        """Does this row verify by the rejection rule? Unseeded sampled rows under
        verify="rejection". Seeded ones verify by the match rule with uniforms indexed by
        output position, so their text is AR sampling's with the same seed whatever the
        batch and width; greedy rows by the match rule on argmaxes (the same as rejection there)."""
        return self.verify == "rejection" and r.params.temperature > 0 and r.params.seed is None

    def _param_tensors(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        temps = torch.tensor([r.params.temperature for r in requests], device=self.device)
        top_ps = torch.tensor([r.params.top_p for r in requests], device=self.device)
        return temps, top_ps

    # --- prefill ------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> DecodeBatch:
        """Run the prompts through the target, emit each request's first token (the first anchor)."""
        return self.start_prefill(prompts, params).advance()

    def start_prefill(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> "Prefill":
        """A prefill to run in chunks (Prefill.advance), e.g. between a server's decode steps."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not prompts or len(prompts) != len(params):
            raise ValueError("prefill needs one SamplingParams per prompt and at least one prompt")
        for p, sp in zip(prompts, params):
            if not p:
                raise ValueError("empty prompt: at least one token is needed")
            if len(p) + sp.max_new_tokens + self.max_width > self.max_positions:
                raise ValueError(f"prompt of {len(p)} tokens + max_new_tokens {sp.max_new_tokens} exceeds the "
                                 f"target's context of {self.max_positions} tokens")
        return Prefill(self, prompts, params)  # dflash.prefill

    # --- one speculative cycle ----------------------------------------------------------
    @torch.no_grad()
    def draft_scores(self, batch: DecodeBatch) -> torch.Tensor:
        """One drafter pass over [anchor, MASK x (B-1)] per row -> logits (b, B-1, K) over
        the drafter's K draftable tokens (self.head) for positions next_pos+1 .. next_pos+B-1."""
        b, B = len(batch), self.block_size
        block = torch.full((b, B), self.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = batch.anchor
        positions = batch.next_pos[:, None] + torch.arange(B, device=self.device)
        hidden = self.drafter(self.drafter.embed_block(self.target.embed, block), positions, batch.context,
                              extend_attention_mask(batch.slot_valid, B, causal=False))
        return self.head.logits(hidden[:, 1:])

    def draft_logits(self, batch: DecodeBatch) -> torch.Tensor:
        """draft_scores over the whole target vocabulary (b, B-1, V): -inf where undraftable."""
        return self.head.full(self.draft_scores(batch))

    def _copies(self, r: Request, extra: list[int] = ()) -> Iterator[tuple[list[int], str]]:
        """The guesses that need no drafter pass, best first, lazily: what followed the
        sequence's last tokens earlier in it ("lookup"), then the corpus's continuation of
        them ("corpus"). extra: tokens taken as appended for this guess only (a tree
        branch's first token)."""
        if r.lookup is not None and (c := r.lookup.propose(extra)) is not None:
            yield c, "lookup"
        if self.corpus is not None and \
                (c := self.corpus.propose(r.last_tokens(max(CORPUS_ORDERS)) + list(extra))) is not None:
            yield c, "corpus"

    def _copy(self, r: Request, extra: list[int] = ()) -> tuple[list[int] | None, str | None]:
        """The best guess that needs no drafter pass and its source, or (None, None)."""
        return next(self._copies(r, extra), (None, None))

    def _guesses(self, r: Request) -> dict[int, list[int]]:
        """{source index: drafts} of the copy guesses (dflash.width.SOURCES): under adaptive
        width every copy source, scored even when unused; pinned, the first one only."""
        if self.policy is None:
            c, src = self._copy(r)
            return {} if c is None else {SOURCES.index(src): c}
        return {SOURCES.index(src): c for c, src in self._copies(r)}

    def _pinned_plan(self, guesses: list[dict[int, list[int]]]) -> Plan:
        """Every row verifies its whole guess (a copy first, else the drafter's block)."""
        sources, lengths = [], []
        for g in guesses:
            if g:
                s = min(g)
                sources.append(s)
                lengths.append(len(g[s]))
            elif self.drafter is not None:
                sources.append(DRAFTER)
                lengths.append(self.block_size - 1)
            else:
                sources.append(-1)
                lengths.append(0)
        return Plan(max(lengths) + 1, DRAFTER in sources, sources, lengths)

    def _drafter_block(self, batch: DecodeBatch, temps, top_ps, rejecting: list[bool]
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's block for every row (b, B-1): its argmax, or for the rows that verify
        by the rejection rule a sample drawn with the row's own uniforms; and those rows'
        distributions (r, B-1, V; None when none rejects). Each depends on the context alone,
        which is what the rejection rule needs."""
        B = self.block_size
        logits = self.draft_scores(batch)  # (b, B-1, K) over the draft vocabulary
        d = self.head.token_ids(greedy_tokens(logits))
        if not any(rejecting):
            return d, None
        rows = torch.tensor([i for i, x in enumerate(rejecting) if x], device=self.device)
        q = token_probs(self.head.full(logits[rows]), temps[rows], top_ps[rows])  # (r, B-1, V)
        gens = [batch.requests[i].generator for i in rows.tolist()]
        d[rows] = sample_from(q, row_uniforms(gens, [B - 1] * len(gens), B - 1).to(self.device))
        return d, q

    def _assemble(self, batch: DecodeBatch, plan: Plan, guesses, block: torch.Tensor | None,
                  q_block: torch.Tensor | None, rejecting: list[bool]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(b, W-1) drafts: row i's own plan.lengths[i] from its source, padded with its last
        draft (or its anchor); the verify accepts nothing past a row's own drafts. And for the
        rejecting rows the distributions they were drawn from (r, W-1, V): the drafter's q, or
        a one-hot for a copy (a proposal with probability one)."""
        W = plan.width
        draft = batch.anchor[:, None].repeat(1, W - 1)
        anchors = batch.anchor.tolist()
        for i, (src, n) in enumerate(zip(plan.sources, plan.lengths)):
            if n == 0:
                continue
            if src == DRAFTER:
                own = block[i, :n]
            else:
                own = torch.tensor(guesses[i][src][:n], device=self.device)
            draft[i, :n] = own
            draft[i, n:] = own[-1] if n else anchors[i]
        if not any(rejecting):
            return draft, None
        rows = [i for i, x in enumerate(rejecting) if x]
        q = torch.zeros(len(rows), W - 1, self.target.vocab_size, device=self.device)
        q.scatter_(-1, draft[rows][..., None], 1.0)
        for j, i in enumerate(rows):  # q_block holds the same rows, in the same order
            if plan.sources[i] == DRAFTER:
                q[j, :plan.lengths[i]] = q_block[j, :plan.lengths[i]]
        return draft, q

    @torch.no_grad()
    def step(self, batch: DecodeBatch) -> list[list[int]]:
        """Plan, draft, verify, accept, commit. Returns the tokens each request emitted this cycle.

        Finished requests must have been removed (see `generate` / `drop_finished`).
        """
        if self.tree is not None:
            return self._step_tree(batch)
        b = len(batch)
        temps, top_ps = self._param_tensors(batch.requests)

        t0 = time.perf_counter()
        guesses = [self._guesses(r) for r in batch.requests]
        if self.policy is not None:
            plan = self.policy.plan([r.width for r in batch.requests], guesses,
                                    self.block_size if self.drafter is not None else None)
        else:
            plan = self._pinned_plan(guesses)
        W = plan.width
        rejecting = [W > 1 and n > 0 and self._rejects(r) for r, n in zip(batch.requests, plan.lengths)]
        t_plan = time.perf_counter()
        block = q_block = None
        if plan.drafter:
            block, q_block = self._drafter_block(batch, temps, top_ps, rejecting)
        draft, q = self._assemble(batch, plan, guesses, block, q_block, rejecting) if W > 1 else (None, None)
        positions = batch.next_pos[:, None] + torch.arange(W, device=self.device)  # (b, W)
        verify_ids = batch.anchor[:, None] if draft is None else torch.cat([batch.anchor[:, None], draft], dim=1)
        self._sync()
        t1 = time.perf_counter()
        out = self.target.forward(verify_ids, positions, extend_attention_mask(batch.slot_valid, W, causal=True),
                                  batch.cache, tap_layer_ids=self.tap_ids if self.drafter is not None else None)
        # greedy and match rows: the target's own token at every slot, sampled with the
        # uniforms of its output position; rejecting rows are decided below
        matching = {i for i, x in enumerate(rejecting) if not x}
        y = target_tokens(out.logits, temps.masked_fill(torch.tensor(rejecting, device=self.device), 0.0), top_ps,
                          self._position_uniforms(batch, W, matching))
        lengths = torch.tensor(plan.lengths, device=self.device)
        if draft is None:
            n_acc, bonus = torch.zeros(b, dtype=torch.long, device=self.device), y[:, 0]
        else:
            n_acc, bonus = verify_match(draft, y, lengths)
        if q is not None:
            rows = torch.tensor([i for i, x in enumerate(rejecting) if x], device=self.device)
            gens = [batch.requests[i].generator for i in rows.tolist()]
            p = token_probs(out.logits[rows], temps[rows], top_ps[rows])  # (r, W, V)
            u_accept = row_uniforms(gens, lengths[rows].tolist(), W - 1).to(self.device)
            u_bonus = row_uniforms(gens, [1] * len(gens), 1)[:, 0].to(self.device)
            n_acc[rows], bonus[rows] = verify_rejection(draft[rows], q, p, u_accept, u_bonus, lengths[rows])
        self._sync()
        t2 = time.perf_counter()

        # commit: keep anchor + accepted drafts (keep = n_acc + 1 slots of this block)
        keep = n_acc + 1
        new_valid = torch.arange(int(keep.max()), device=self.device)[None] < keep[:, None]
        self._commit(batch, out, positions, new_valid, keep, bonus)
        draft_list = draft.tolist() if draft is not None else [[]] * b
        tokens = [draft_list[i][:int(n)] + [int(bonus[i])] for i, n in enumerate(n_acc.tolist())]
        sources = [SOURCES[s] if s >= 0 else None for s in plan.sources]
        starts = [len(r.output_ids) for r in batch.requests]
        emitted = self._emit(batch, tokens, sources, W, plan.lengths, t1 - t_plan if plan.drafter else 0.0, t2 - t1)
        if self.policy is not None:
            self._learn(batch, plan, guesses, block, starts)
            self._sync()
            costs = self.policy.costs
            costs.observe("verify", b, W, t2 - t1)
            if plan.drafter:
                costs.observe("drafter", b, 1, t1 - t_plan)
            costs.observe("overhead", b, 1, (t_plan - t0) + (time.perf_counter() - t2))
        return emitted

    def _learn(self, batch: DecodeBatch, plan: Plan, guesses, block: torch.Tensor | None, starts: list[int]) -> None:
        """Adaptive width: keep this cycle's guesses (the drafter's whole block when it ran)
        to score against the tokens emitted from `starts` on, score what is decided."""
        block_list = block.tolist() if block is not None else None
        for i, r in enumerate(batch.requests):
            row = r.width
            for src, drafts in guesses[i].items():
                self.policy.propose(row, src, drafts, starts[i])
            if block_list is not None:
                self.policy.propose(row, DRAFTER, block_list[i], starts[i])
                row.since_drafter = 0
            else:
                row.since_drafter += 1
            self.policy.score(row, r.output_ids, finished=r.finished)

    def calibrate(self, budget_s: float = CALIBRATION_S, context: int = 128) -> dict[int, float]:
        """Time the passes this decoder may run into its cost model (dflash.width.calibrate)."""
        return calibrate(self, budget_s, context)

    def _commit(self, batch: DecodeBatch, out, positions: torch.Tensor, new_valid: torch.Tensor,
                keep: torch.Tensor, bonus: torch.Tensor) -> None:
        """Keep this cycle's verified slots: new_valid (b, width) marks them among the first
        `width` of the W slots the verify appended (the rest are cropped), keep (b,) counts
        them per row, bonus (b,) is each row's next anchor."""
        width, s = new_valid.shape[1], batch.num_slots
        if positions.shape[1] > width:
            batch.cache.crop(-(positions.shape[1] - width))
        if self.drafter is not None:
            taps = out.taps[:, :width].masked_fill(~new_valid[..., None], 0)
            batch.context = concat_context(batch.context, self.drafter.context_kv(taps, positions[:, :width]))
        batch.slot_valid = torch.cat([batch.slot_valid, new_valid], dim=1)
        assert batch.slot_valid.shape[1] == s + width
        batch.next_pos = batch.next_pos + keep
        batch.anchor = bonus

    def _emit(self, batch: DecodeBatch, tokens: list[list[int]], sources: list, width: int, own: list[int],
              draft_s: float, verify_s: float) -> list[list[int]]:
        """Record each row's cycle (the verify width, its source: "drafter", "lookup",
        "corpus" or None, its own drafts) and emit its tokens."""
        emitted = []
        for r, toks, source, n in zip(batch.requests, tokens, sources, own):
            r.stats.record(width, source, n, len(toks) - 1)
            r.stats.draft_time_s += draft_s
            r.stats.verify_time_s += verify_s
            emitted.append(r.emit(toks, self.stops(r.params)))
        return emitted

    # --- a cycle that verifies a draft tree (dflash.tree) -------------------------------
    def _tree_branches(self, batch: DecodeBatch) -> list[list[tuple[list[int], str]]]:
        """Each row's guesses after its anchor, best first: the context copy, the corpus
        copy, the drafter's block, then the drafter's runner-up first tokens, each continued
        by a context or corpus copy after it (else by the rest of the drafter's block)."""
        depth = self.max_width - 1
        chain = top = None
        if self.drafter is not None:
            logits = self.draft_scores(batch)  # (b, B-1, K)
            chain = self.head.token_ids(greedy_tokens(logits)).tolist()
            k = min(self.tree.first_candidates, logits.shape[-1])
            top = self.head.token_ids(logits[:, 0].topk(k, dim=-1).indices).tolist()
        rows = []
        for i, r in enumerate(batch.requests):
            branches = list(self._copies(r))
            if chain is not None:
                branches.append((chain[i], "drafter"))
                for tok in top[i][1:]:
                    rest, _ = self._copy(r, [tok])
                    branches.append(([tok] + (rest or chain[i][1:]), "drafter"))
            rows.append([(br[:depth], src) for br, src in branches])
        return rows

    def _step_tree(self, batch: DecodeBatch) -> list[list[int]]:
        """One cycle over a draft tree: every row's guesses in one target pass, the longest
        path of the target's own tokens kept (dflash.tree), the rest left as holes."""
        b, s = len(batch), batch.num_slots
        temps, top_ps = self._param_tensors(batch.requests)
        t0 = time.perf_counter()
        tree: DraftTree = build_tree(batch.anchor.tolist(), self._tree_branches(batch), self.tree.max_nodes,
                                     device=self.device)
        W = tree.width  # this cycle's verify width: the widest row's tree
        positions = batch.next_pos[:, None] + tree.depth  # (b, W)
        mask = torch.cat([batch.slot_valid[:, None, :].expand(b, W, s), tree.attend], dim=-1)[:, None]
        self._sync()
        t1 = time.perf_counter()
        out = self.target.forward(tree.tokens, positions, mask, batch.cache,
                                  tap_layer_ids=self.tap_ids if self.drafter is not None else None)
        # each node's token sampled with the uniform of its output position (its depth): the
        # path's tokens are AR sampling's whatever the tree holds
        depth = int(tree.depth.max()) + 1
        u = self._position_uniforms(batch, depth).gather(1, tree.depth.to(self.device))
        y = target_tokens(out.logits, temps, top_ps, u)  # (b, W)
        paths, bonus = tree.walk(y.tolist())
        self._sync()
        t2 = time.perf_counter()

        # commit: keep each row's path; the cache keeps the first `width` slots of the tree
        new_valid = torch.zeros(b, max(max(path) for path in paths) + 1, dtype=torch.bool)
        for i, path in enumerate(paths):
            new_valid[i, path] = True
        keep = torch.tensor([len(path) for path in paths], device=self.device)
        self._commit(batch, out, positions, new_valid.to(self.device), keep, torch.tensor(bonus, device=self.device))
        nodes = tree.tokens.tolist()
        tokens = [[nodes[i][n] for n in path[1:]] + [bonus[i]] for i, path in enumerate(paths)]
        sources = [tree.source[i][path[-1]] for i, path in enumerate(paths)]
        return self._emit(batch, tokens, sources, W, [len(t) - 1 for t in tokens], t1 - t0, t2 - t1)

    # --- driving loop -------------------------------------------------------------------
    def drop_finished(self, batch: DecodeBatch) -> tuple[DecodeBatch | None, list[Request]]:
        """Remove finished requests; compact the caches when holes exceed a quarter of the slots."""
        done = [r for r in batch.requests if r.finished]
        now = time.perf_counter()
        for r in done:
            r.stats.total_time_s = now - r.started
        if len(done) == len(batch):
            return None, done
        if done:
            batch = select_rows(batch, [i for i, r in enumerate(batch.requests) if not r.finished])
        holes = batch.num_slots - int(batch.slot_valid.sum(1).max())
        if holes > max(16, batch.num_slots // 4):
            batch = compact(batch)
        return batch, done

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 batch_size: int | None = None) -> list[Request]:
        """Decode every prompt to completion, `batch_size` at a time (all at once by default)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        size = batch_size or len(prompts)
        results: list[Request] = []
        for start in range(0, len(prompts), size):
            batch = self.prefill(prompts[start:start + size], params[start:start + size])
            results.extend(batch.requests)
            batch, _ = self.drop_finished(batch)
            while batch is not None:
                self.step(batch)
                batch, _ = self.drop_finished(batch)
        return results
