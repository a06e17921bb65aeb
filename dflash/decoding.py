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

The batch state and its cache layout (slots, holes, compaction) live in dflash.batch.
Each request draws its random numbers from its own generator, as many as its own draft
needs (dflash.sampling.row_uniforms), so a seeded request decodes the same text alone or
in any batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from dflash.batch import DecodeBatch, Request, RequestStats, compact, select_rows
from dflash.config import check_drafter_fits
from dflash.corpus import ORDERS as CORPUS_ORDERS
from dflash.corpus import CorpusIndex
from dflash.drafter import DFlashDrafter, OutputHead, concat_context
from dflash.lookup import LookupConfig, NgramIndex
from dflash.masks import causal_attention_mask, extend_attention_mask
from dflash.sampling import (VERIFY_RULES, SamplingParams, greedy_tokens, row_uniforms, sample_from, target_tokens,
                             token_probs, verify_match, verify_rejection)
from dflash.target import Target
from dflash.tree import DraftTree, TreeConfig, build_tree

# the old name; serve/app.py and dflash/checkpoint.py still import it from here
check_drafter_matches_target = check_drafter_fits


class SpeculativeDecoder:
    """Target (+ optional DFlash drafter, + optional context lookup) -> batched lossless decoding.

    verify: "rejection" (default; accepts more at T > 0) or "match"; greedy requests are
    exact under either. block_size defaults to the drafter's decode_block_size (its training
    block size unless its config says otherwise); 1 without a drafter. lookup: a sequence
    whose last tokens occurred earlier drafts lookup.num_tokens copied tokens instead
    (dflash.lookup); corpus: else a sequence whose last tokens the corpus knows drafts their
    chained continuations (dflash.corpus). A cycle verifies the batch's longest draft (at
    most max_width tokens), and each row accepts only from its own. tree: verify a draft tree of every guess instead (dflash.tree; at
    T > 0 its walk is the match rule, whatever `verify` says).
    """

    def __init__(self, target: Target, drafter: DFlashDrafter | None = None,
                 verify: str = "rejection", block_size: int | None = None, lookup: LookupConfig | None = None,
                 corpus: CorpusIndex | None = None, tree: TreeConfig | None = None):
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

    @property
    def device(self) -> torch.device:
        return self.target.device

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _uniforms(self, batch: DecodeBatch, counts: list[int], width: int) -> torch.Tensor:
        """(b, width) uniforms: counts[i] from row i's own generator, then zeros (row_uniforms)."""
        return row_uniforms([r.generator for r in batch.requests], counts, width).to(self.device)

    def _param_tensors(self, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        temps = torch.tensor([r.params.temperature for r in requests], device=self.device)
        top_ps = torch.tensor([r.params.top_p for r in requests], device=self.device)
        return temps, top_ps

    # --- prefill ------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> DecodeBatch:
        """Run the prompts through the target, emit each request's first token (the first anchor)."""
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
        t0 = time.perf_counter()
        requests = []
        for p, sp in zip(prompts, params):
            g = torch.Generator()
            g.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            index = NgramIndex(self.lookup, p) if self.lookup is not None else None
            requests.append(Request(list(p), sp, RequestStats(self.max_width, prompt_tokens=len(p)), g,
                                    started=t0, lookup=index))
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lens.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, device=self.device)
        valid = torch.arange(width, device=self.device)[None] >= (width - lens)[:, None]
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.target.config)
        out = self.target.forward(ids, positions, causal_attention_mask(valid), cache,
                                  tap_layer_ids=self.tap_ids if self.drafter is not None else None,
                                  logits_slice=slice(-1, None))
        context = None
        if self.drafter is not None:
            taps = out.taps.masked_fill(~valid[..., None], 0)
            context = self.drafter.context_kv(taps, positions)
        batch = DecodeBatch(requests, cache, context, valid, lens.clone(), torch.zeros_like(lens))
        temps, top_ps = self._param_tensors(requests)
        first = target_tokens(out.logits, temps, top_ps, self._uniforms(batch, [1] * len(batch), 1))[:, 0]
        batch.anchor = first
        self._sync()
        dt = time.perf_counter() - t0
        for r, tok in zip(requests, first.tolist()):
            r.stats.prefill_time_s = dt
            r.emit([tok], self.stop_token_ids | set(r.params.stop_token_ids))
        return batch

    # --- one speculative cycle ----------------------------------------------------------
    @torch.no_grad()
    def draft_scores(self, batch: DecodeBatch) -> torch.Tensor:
        """One drafter pass over [anchor, MASK x (B-1)] per row -> logits (b, B-1, K) over
        the drafter's K draftable tokens (self.head) for positions next_pos+1 .. next_pos+B-1."""
        b, B = len(batch), self.block_size
        block = torch.full((b, B), self.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = batch.anchor
        positions = batch.next_pos[:, None] + torch.arange(B, device=self.device)
        hidden = self.drafter(self.target.embed(block), positions, batch.context,
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

    def _draft(self, batch: DecodeBatch, copies: list, W: int, temps, top_ps, u_draft: torch.Tensor,
               rejection: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This cycle's drafts (b, W-1) and, for the rejection rule, the distributions they
        were drawn from (b, W-1, V; else None). W: this cycle's verify width.

        A row with a copy (copies[i], from the context or the corpus) drafts it, a proposal
        with probability one. The other rows draft with the drafter: its argmax, or under
        the rejection rule a sample drawn with u_draft (b, B-1). A row shorter than W-1 is
        padded with its last draft (or its anchor, without any draft); the verify accepts
        nothing past a row's own draft (dflash.sampling, `lengths`). Every draft depends on
        the context alone, which is what the rejection rule needs."""
        b, B = len(batch), self.block_size
        draft = batch.anchor[:, None].repeat(1, W - 1)  # placeholders, overwritten below
        from_drafter = [c is None for c in copies]
        q_drafter = None
        if self.drafter is not None and any(from_drafter):
            logits = self.draft_scores(batch)  # (b, B-1, K) over the draft vocabulary
            if rejection:
                q_drafter = token_probs(self.head.full(logits), temps, top_ps)  # (b, B-1, V)
                d = sample_from(q_drafter, u_draft)
            else:
                d = self.head.token_ids(greedy_tokens(logits))
            draft[:, : B - 1] = d
            draft[:, B - 1:] = d[:, -1:]
        for i, c in enumerate(copies):
            if c is not None:
                draft[i] = torch.tensor((c + c[-1:] * W)[: W - 1], device=self.device)
        if not rejection:
            return draft, None
        q = torch.zeros(b, W - 1, self.target.vocab_size, device=self.device).scatter_(-1, draft[..., None], 1.0)
        if q_drafter is not None:
            rows = torch.tensor(from_drafter, device=self.device)
            q[rows, : B - 1] = q_drafter[rows]
        return draft, q

    @torch.no_grad()
    def step(self, batch: DecodeBatch) -> list[list[int]]:
        """Draft, verify, accept, commit. Returns the tokens each request emitted this cycle.

        Finished requests must have been removed (see `generate` / `drop_finished`).
        """
        if self.tree is not None:
            return self._step_tree(batch)
        b, B = len(batch), self.block_size
        temps, top_ps = self._param_tensors(batch.requests)
        # the rejection rule on greedy rows is the match rule on argmaxes (dflash.sampling):
        # distributions are built only for a cycle with a sampled row
        rejection = self.verify == "rejection" and bool((temps > 0).any())

        t0 = time.perf_counter()
        copies, sources = zip(*[self._copy(r) for r in batch.requests])
        lengths = [len(c) if c is not None else B - 1 for c in copies]  # each row's own drafts
        W = max(lengths) + 1  # this cycle's verify width: the anchor and the longest draft
        # each row's own draws, in this order: drafter samples, acceptance tests, the target's tokens
        u_draft = self._uniforms(batch, [B - 1 if c is None else 0 for c in copies], B - 1)
        u_accept = self._uniforms(batch, lengths, W - 1)
        u_target = self._uniforms(batch, [n + 1 for n in lengths], W)
        draft, q = self._draft(batch, copies, W, temps, top_ps, u_draft, rejection) if W > 1 else (None, None)
        positions = batch.next_pos[:, None] + torch.arange(W, device=self.device)  # (b, W)
        verify_ids = batch.anchor[:, None] if draft is None else torch.cat([batch.anchor[:, None], draft], dim=1)
        self._sync()
        t1 = time.perf_counter()
        out = self.target.forward(verify_ids, positions, extend_attention_mask(batch.slot_valid, W, causal=True),
                                  batch.cache, tap_layer_ids=self.tap_ids if self.drafter is not None else None)
        lengths_t = torch.tensor(lengths, device=self.device)
        if draft is None:
            n_acc = torch.zeros(b, dtype=torch.long, device=self.device)
            bonus = target_tokens(out.logits, temps, top_ps, u_target)[:, 0]
        elif rejection:
            p = token_probs(out.logits, temps, top_ps)  # (b, W, V)
            u_bonus = u_target.gather(1, lengths_t[:, None])[:, 0]  # the row's draw after its own drafts
            n_acc, bonus = verify_rejection(draft, q, p, u_accept, u_bonus, lengths_t)
        else:
            n_acc, bonus = verify_match(draft, target_tokens(out.logits, temps, top_ps, u_target), lengths_t)
        self._sync()
        t2 = time.perf_counter()

        # commit: keep anchor + accepted drafts (keep = n_acc + 1 slots of this block)
        keep = n_acc + 1
        new_valid = torch.arange(int(keep.max()), device=self.device)[None] < keep[:, None]
        self._commit(batch, out, positions, new_valid, keep, bonus)
        draft_list = draft.tolist() if draft is not None else [[]] * b
        tokens = [draft_list[i][:int(n)] + [int(bonus[i])] for i, n in enumerate(n_acc.tolist())]
        return self._emit(batch, tokens, sources, t1 - t0, t2 - t1)

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

    def _emit(self, batch: DecodeBatch, tokens: list[list[int]], sources: list, draft_s: float,
              verify_s: float) -> list[list[int]]:
        """Record each row's cycle (its source: "lookup", "corpus" or None) and emit its tokens."""
        emitted = []
        for r, toks, source in zip(batch.requests, tokens, sources):
            r.stats.acceptance_lengths.append(len(toks))
            r.stats.lookup_cycles += source == "lookup"
            r.stats.corpus_cycles += source == "corpus"
            r.stats.draft_time_s += draft_s
            r.stats.verify_time_s += verify_s
            emitted.append(r.emit(toks, self.stop_token_ids | set(r.params.stop_token_ids)))
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
        y = target_tokens(out.logits, temps, top_ps, self._uniforms(batch, tree.num_nodes, W))  # (b, W)
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
        return self._emit(batch, tokens, sources, t1 - t0, t2 - t1)

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
