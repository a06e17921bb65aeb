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
widest of the drafts. With a TreeConfig, a cycle instead verifies all of these guesses at
once as a token tree and keeps the longest path of the target's own tokens (dflash.tree).

Cache layout. Sequences in a batch accept different numbers of tokens, so slots are not
positions. Both the target's KV cache and the drafter's context cache have the same S
slots per row, and `slot_valid` (b, S) says which slots hold a verified token of that row;
padding and rejected drafts are holes. Positions are tracked per row (`next_pos`), and
every attention mask is built from `slot_valid` (dflash.masks), so holes cost memory but
never change results. Worked example, B=4, two rows after a cycle where row 0 accepted 2
drafts and row 1 accepted none:
    slots appended this cycle   [a  d1 d2 d3]         keep = num_accepted + 1 = [3, 1]
    cache cropped to S + max(keep) = S + 3 slots
    row 0 valid  [.. 1 1 1]     row 1 valid  [.. 1 0 0]      next_pos += [3, 1]
`compact()` squeezes the holes out (a per-row gather) once they pile up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.corpus import ORDERS as CORPUS_ORDERS
from dflash.corpus import CorpusIndex
from dflash.drafter import DFlashDrafter, OutputHead, concat_context
from dflash.lookup import LookupConfig, NgramIndex
from dflash.masks import causal_attention_mask, extend_attention_mask
from dflash.sampling import (VERIFY_RULES, greedy_tokens, sample_from, target_tokens, token_probs, verify_match,
                             verify_rejection)
from dflash.target import Target
from dflash.tree import DraftTree, TreeConfig, build_tree


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 = greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RequestStats:
    """Speculative statistics of one request. Times are the wall time of the batched
    passes this request took part in."""

    block_size: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted + 1, per cycle
    lookup_cycles: int = 0  # cycles whose draft was copied from the context (dflash.lookup)
    corpus_cycles: int = 0  # cycles whose draft came from the corpus (dflash.corpus)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle (accepted drafts + the bonus), in [1, B]."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def histogram(self) -> list[int]:
        """counts[i] = cycles that emitted i+1 tokens, i in 0..block_size-1 (the widest cycle)."""
        counts = [0] * self.block_size
        for n in self.acceptance_lengths:
            counts[min(n, self.block_size) - 1] += 1
        return counts

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cycles": len(self.acceptance_lengths),
            "lookup_cycles": self.lookup_cycles,
            "corpus_cycles": self.corpus_cycles,
            "tau": round(self.tau, 4),
            "acceptance_lengths": list(self.acceptance_lengths),
            "acceptance_histogram": self.histogram(),
            "prefill_time_s": round(self.prefill_time_s, 5),
            "draft_time_s": round(self.draft_time_s, 5),
            "verify_time_s": round(self.verify_time_s, 5),
            "total_time_s": round(self.total_time_s, 5),
            "tokens_per_s": round(self.generated_tokens / self.total_time_s, 3) if self.total_time_s > 0 else 0.0,
        }


@dataclass
class Request:
    """One sequence in flight: its parameters, output so far and statistics."""

    prompt_ids: list[int]
    params: SamplingParams
    stats: RequestStats
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    started: float = field(default_factory=time.perf_counter)
    lookup: NgramIndex | None = None  # prompt + output, for context lookup drafts

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def last_tokens(self, n: int) -> list[int]:
        """The last n tokens of prompt + output (fewer if the sequence is shorter)."""
        if len(self.output_ids) >= n:
            return self.output_ids[-n:]
        return (self.prompt_ids + self.output_ids)[-n:]

    def emit(self, tokens: list[int], stop_ids: set[int]) -> list[int]:
        """Append tokens up to a stop token (kept) or max_new_tokens; return what was added."""
        added = []
        for tok in tokens:
            if self.finished:
                break
            self.output_ids.append(tok)
            added.append(tok)
            if self.lookup is not None:
                self.lookup.extend([tok])
            if tok in stop_ids:
                self.finish_reason = "stop"
            elif len(self.output_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        self.stats.generated_tokens = len(self.output_ids)
        return added


@dataclass
class DecodeBatch:
    """The state of a batch in flight. All tensors share the row order of `requests`."""

    requests: list[Request]
    cache: DynamicCache  # target KV, S slots
    context: list | None  # drafter context K/V per layer, S slots (None without a drafter)
    slot_valid: torch.Tensor  # (b, S) bool
    next_pos: torch.Tensor  # (b,) position of the anchor = number of verified tokens
    anchor: torch.Tensor  # (b,) last emitted token, not yet in either cache

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_slots(self) -> int:
        return self.slot_valid.shape[1]


# --- cache surgery: the same slot operation applied to the target cache and the context ---

def _map_kv(batch: DecodeBatch, fn) -> None:
    for layer in batch.cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window target layers are not supported by DFlash decoding")
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)
    if batch.context is not None:
        batch.context = [(fn(k), fn(v)) for k, v in batch.context]


def select_rows(batch: DecodeBatch, rows: list[int]) -> DecodeBatch:
    """Keep only `rows` (e.g. drop finished requests)."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.slot_valid.device)
    _map_kv(batch, lambda x: x.index_select(0, idx.to(x.device)))
    return DecodeBatch(
        requests=[batch.requests[i] for i in rows], cache=batch.cache, context=batch.context,
        slot_valid=batch.slot_valid[idx], next_pos=batch.next_pos[idx], anchor=batch.anchor[idx])


def compact(batch: DecodeBatch) -> DecodeBatch:
    """Squeeze out holes: each row's valid slots, in order, right-aligned in S' = max valid."""
    valid = batch.slot_valid
    width = int(valid.sum(1).max())
    if width == valid.shape[1]:
        return batch
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]  # (b, S')

    def gather(x):  # x (b, h, S, d)
        idx = order.to(x.device)[:, None, :, None].expand(x.shape[0], x.shape[1], width, x.shape[3])
        return x.gather(2, idx)

    _map_kv(batch, gather)
    batch.slot_valid = valid.gather(1, order)
    return batch


def merge(a: DecodeBatch, b: DecodeBatch) -> DecodeBatch:
    """Join two batches (requests joining between steps): left-pad to a common slot count."""
    s = max(a.num_slots, b.num_slots)
    for part in (a, b):
        pad = s - part.num_slots
        if pad:
            _map_kv(part, lambda x, pad=pad: torch.nn.functional.pad(x, (0, 0, pad, 0)))
            part.slot_valid = torch.nn.functional.pad(part.slot_valid, (pad, 0), value=False)
    for la, lb in zip(a.cache.layers, b.cache.layers):
        la.keys, la.values = torch.cat([la.keys, lb.keys]), torch.cat([la.values, lb.values])
    context = None
    if a.context is not None:
        context = [(torch.cat([ka, kb]), torch.cat([va, vb])) for (ka, va), (kb, vb) in zip(a.context, b.context)]
    return DecodeBatch(
        requests=a.requests + b.requests, cache=a.cache, context=context,
        slot_valid=torch.cat([a.slot_valid, b.slot_valid]), next_pos=torch.cat([a.next_pos, b.next_pos]),
        anchor=torch.cat([a.anchor, b.anchor]))


class SpeculativeDecoder:
    """Target (+ optional DFlash drafter, + optional context lookup) -> batched lossless decoding.

    verify: "rejection" (default; accepts more at T > 0) or "match"; greedy requests are
    exact under either. block_size defaults to the drafter's decode_block_size (its training
    block size unless its config says otherwise); 1 without a drafter. lookup: a sequence
    whose last tokens occurred earlier drafts lookup.num_tokens copied tokens instead
    (dflash.lookup); corpus: else a sequence whose last tokens the corpus knows drafts their
    chained continuations (dflash.corpus). A cycle verifies its longest draft (at most
    max_width tokens). tree: verify a draft tree of every guess instead (dflash.tree; at
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
            check_drafter_matches_target(cfg, target)
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

    def _uniforms(self, batch: DecodeBatch, n: int) -> torch.Tensor:
        """(b, n) uniforms, each row from its own request's generator."""
        return torch.stack([torch.rand(n, generator=r.generator) for r in batch.requests]).to(self.device)

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
        first = target_tokens(out.logits, temps, top_ps, self._uniforms(batch, 1))[:, 0]
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

    def _propose(self, r: Request) -> tuple[list[int] | None, str | None]:
        """A draft that needs no drafter pass, and where it came from: the context, the corpus or none."""
        if r.lookup is not None and (c := r.lookup.propose()) is not None:
            return c, "lookup"
        if self.corpus is not None and (c := self.corpus.propose(r.last_tokens(max(CORPUS_ORDERS)))) is not None:
            return c, "corpus"
        return None, None

    def _draft(self, batch: DecodeBatch, temps, top_ps, u, rejection: bool
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, list]:
        """This cycle's drafts (b, W-1), the distributions they were drawn from (b, W-1, V;
        built only for the rejection rule, else None) and per row where its draft came from
        ("lookup", "corpus" or None for the drafter); W is this cycle's verify width: the
        longest draft + 1, at least block_size while any row drafts with the drafter
        (drafts None when W = 1).

        A lookup or corpus draft is a proposal with probability one; a short one is padded
        with its last token. The other rows draft with the drafter: its argmax, or a sample
        under the rejection rule; slots past its block repeat its last draft with
        probability one. Every draft depends on the context alone, which is what the
        rejection rule needs."""
        b, B = len(batch), self.block_size
        copies, sources = zip(*[self._propose(r) for r in batch.requests])
        copied = [c is not None for c in copies]
        W = max([len(c) + 1 for c in copies if c is not None] + ([B] if not all(copied) else []))
        if W == 1:
            return None, None, list(sources)
        draft = batch.anchor[:, None].repeat(1, W - 1)  # placeholders, overwritten below
        q_drafter = None
        if self.drafter is not None and not all(copied):
            logits = self.draft_scores(batch)  # (b, B-1, K) over the draft vocabulary
            if rejection:
                q_drafter = token_probs(self.head.full(logits), temps, top_ps)  # (b, B-1, V)
                d = sample_from(q_drafter, u[:, : B - 1])
            else:
                d = self.head.token_ids(greedy_tokens(logits))
            draft[:, : B - 1] = d
            draft[:, B - 1:] = d[:, -1:]
        for i, c in enumerate(copies):
            if c is not None:
                c = (c + c[-1:] * W)[: W - 1]
                draft[i] = torch.tensor(c, device=self.device)
        if not rejection:
            return draft, None, list(sources)
        q = torch.zeros(b, W - 1, self.target.vocab_size, device=self.device).scatter_(-1, draft[..., None], 1.0)
        if q_drafter is not None:
            rows = torch.tensor([not c for c in copied], device=self.device)
            q[rows, : B - 1] = q_drafter[rows]
        return draft, q, list(sources)

    @torch.no_grad()
    def step(self, batch: DecodeBatch) -> list[list[int]]:
        """Draft, verify, accept, commit. Returns the tokens each request emitted this cycle.

        Finished requests must have been removed (see `generate` / `drop_finished`).
        """
        if self.tree is not None:
            return self._step_tree(batch)
        b = len(batch)
        temps, top_ps = self._param_tensors(batch.requests)
        u = self._uniforms(batch, 3 * self.max_width)  # draft sampling | acceptance | target/bonus draws
        # the rejection rule on greedy rows is the match rule on argmaxes (dflash.sampling):
        # distributions are built only for a cycle with a sampled row
        rejection = self.verify == "rejection" and bool((temps > 0).any())

        t0 = time.perf_counter()
        draft, q, sources = self._draft(batch, temps, top_ps, u, rejection)
        B = 1 if draft is None else draft.shape[1] + 1  # this cycle's verify width
        positions = batch.next_pos[:, None] + torch.arange(B, device=self.device)  # (b, B)
        verify_ids = batch.anchor[:, None] if draft is None else torch.cat([batch.anchor[:, None], draft], dim=1)
        self._sync()
        t1 = time.perf_counter()
        out = self.target.forward(verify_ids, positions, extend_attention_mask(batch.slot_valid, B, causal=True),
                                  batch.cache, tap_layer_ids=self.tap_ids if self.drafter is not None else None)
        if draft is None:
            n_acc = torch.zeros(b, dtype=torch.long, device=self.device)
            bonus = target_tokens(out.logits, temps, top_ps, u[:, 2 * B: 2 * B + 1])[:, 0]
        elif rejection:
            p = token_probs(out.logits, temps, top_ps)  # (b, B, V)
            n_acc, bonus = verify_rejection(draft, q, p, u[:, B - 1: 2 * B - 2], u[:, 2 * B])
        else:
            n_acc, bonus = verify_match(draft, target_tokens(out.logits, temps, top_ps, u[:, 2 * B - 1: 3 * B - 1]))
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
            ctx = r.last_tokens(max(CORPUS_ORDERS))
            branches = []
            if r.lookup is not None and (c := r.lookup.propose()) is not None:
                branches.append((c, "lookup"))
            if self.corpus is not None and (c := self.corpus.propose(ctx)) is not None:
                branches.append((c, "corpus"))
            if chain is not None:
                branches.append((chain[i], "drafter"))
                for tok in top[i][1:]:
                    rest = r.lookup.propose([tok]) if r.lookup is not None else None
                    if rest is None and self.corpus is not None:
                        rest = self.corpus.propose(ctx + [tok])
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
        w = tree.width
        positions = batch.next_pos[:, None] + tree.depth
        mask = torch.cat([batch.slot_valid[:, None, :].expand(b, w, s), tree.attend], dim=-1)[:, None]
        self._sync()
        t1 = time.perf_counter()
        out = self.target.forward(tree.tokens, positions, mask, batch.cache,
                                  tap_layer_ids=self.tap_ids if self.drafter is not None else None)
        y = target_tokens(out.logits, temps, top_ps, self._uniforms(batch, w))  # (b, W)
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


def check_drafter_matches_target(cfg, target: Target) -> None:
    """Refuse a drafter made for another target, naming the mismatch."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.num_target_layers != target.num_layers:
        problems.append(f"made for a {cfg.num_target_layers}-layer target, this target has {target.num_layers}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target's {target.vocab_size}")
    if problems:
        raise ValueError(f"drafter does not fit target {target.target_id}: " + "; ".join(problems))
