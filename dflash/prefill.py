"""Prefill in chunks: prompts enter the target's cache (and the drafter's context) a few
columns at a time, so a server can interleave a long prompt with other requests' decode
steps and drop the prefill of a request that was cancelled.

A Prefill works on a dflash.decoding.SpeculativeDecoder (passed in, not imported: the
decoder creates its prefills) and hands back the DecodeBatch its decode steps continue.
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from dflash.batch import DecodeBatch, Request, RequestStats
from dflash.drafter import concat_context
from dflash.lookup import NgramIndex
from dflash.masks import causal_attention_mask
from dflash.sampling import SamplingParams, target_tokens


class Prefill:
    """Prompts on their way into the target's cache, a chunk of columns at a time.

    The prompts are left-padded to one width t; `advance(max_tokens)` runs the next columns
    [done, done + c) with c = max_tokens // rows (all that is left by default) through the
    target, each column seeing the valid columns before it (the slice of the full causal
    mask), and appends their drafter context. After the last column it samples each
    request's first token and returns the DecodeBatch; before, None. A server interleaves
    these chunks with decode steps and simply drops a Prefill whose request was cancelled.

    Example: prompts of 5 and 3 tokens, advance(4) -> columns 0-1 (2 rows x 2 = 4 tokens),
    then columns 2-3, then column 4 and the first tokens.
    """

    def __init__(self, decoder, prompts: list[list[int]], params: list[SamplingParams]):
        self.decoder = dec = decoder
        self.started = time.perf_counter()
        self.elapsed_s = 0.0
        self.requests = []
        for p, sp in zip(prompts, params):
            g = torch.Generator()
            g.manual_seed(sp.seed if sp.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            index = NgramIndex(dec.lookup, p) if dec.lookup is not None else None
            self.requests.append(Request(list(p), sp, RequestStats(dec.max_width, prompt_tokens=len(p)), g,
                                         started=self.started, lookup=index,
                                         width=dec.policy.new_row() if dec.policy is not None else None))
        self.lens = torch.tensor([len(p) for p in prompts], device=dec.device)
        width = int(self.lens.max())
        self.ids = torch.zeros(len(prompts), width, dtype=torch.long, device=dec.device)
        for i, p in enumerate(prompts):
            self.ids[i, width - len(p):] = torch.tensor(p, device=dec.device)
        self.valid = torch.arange(width, device=dec.device)[None] >= (width - self.lens)[:, None]
        self.positions = (self.valid.long().cumsum(1) - 1).clamp(min=0)
        self.cache = DynamicCache(config=dec.target.config)
        self.context = None
        self.done = 0  # columns already in the cache

    @property
    def remaining_tokens(self) -> int:
        return (self.ids.shape[1] - self.done) * len(self.requests)

    @torch.no_grad()
    def advance(self, max_tokens: int | None = None) -> DecodeBatch | None:
        dec, t0 = self.decoder, time.perf_counter()
        rows, width = len(self.requests), self.ids.shape[1]
        cols = width - self.done if max_tokens is None else max(1, max_tokens // rows)
        a, b = self.done, min(width, self.done + cols)
        mask = causal_attention_mask(self.valid[:, :b])[:, :, a:b]
        drafting = dec.drafter is not None
        out = dec.target.forward(self.ids[:, a:b], self.positions[:, a:b], mask, self.cache,
                                 tap_layer_ids=dec.tap_ids if drafting else None,
                                 logits_slice=slice(-1, None))  # only the last chunk's is used
        if drafting:
            taps = out.taps.masked_fill(~self.valid[:, a:b, None], 0)
            self.context = concat_context(self.context, dec.drafter.context_kv(taps, self.positions[:, a:b]))
        self.done = b
        if b < width:
            dec._sync()
            self.elapsed_s += time.perf_counter() - t0
            return None
        batch = DecodeBatch(self.requests, self.cache, self.context, self.valid, self.lens.clone(),
                            torch.zeros_like(self.lens))
        temps, top_ps = dec._param_tensors(self.requests)
        first = target_tokens(out.logits, temps, top_ps, dec._position_uniforms(batch, 1))[:, 0]
        batch.anchor = first
        dec._sync()
        self.elapsed_s += time.perf_counter() - t0
        for r, tok in zip(self.requests, first.tolist()):
            r.stats.prefill_time_s = self.elapsed_s
            r.emit([tok], dec.stops(r.params))
        return batch
