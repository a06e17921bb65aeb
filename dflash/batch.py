"""The state of a decoding batch in flight, and the slot surgery on its two caches.

Cache layout. Sequences in a batch accept different numbers of tokens, so slots are not
positions. Both the target's KV cache and the drafter's context cache have the same S
slots per row, and `slot_valid` (b, S) says which slots hold a verified token of that row;
padding and rejected drafts are holes. Positions are tracked per row (`next_pos`), and
every attention mask is built from `slot_valid` (dflash.masks), so holes cost memory but
never change results. Worked example, a cycle of width W=4, two rows where row 0 accepted
2 drafts and row 1 accepted none:
    slots appended this cycle   [a  d1 d2 d3]         keep = num_accepted + 1 = [3, 1]
    cache cropped to S + max(keep) = S + 3 slots
    row 0 valid  [.. 1 1 1]     row 1 valid  [.. 1 0 0]      next_pos += [3, 1]
`compact()` squeezes the holes out (a per-row gather) once they pile up; `select_rows()`
drops rows (finished requests) and `merge()` joins a newly prefilled batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dflash.lookup import NgramIndex
from dflash.sampling import SamplingParams
from dflash.width import RowWidth


@dataclass
class RequestStats:
    """Speculative statistics of one request. Times are the wall time of the batched
    passes this request took part in. max_width: the widest verify of its decoder."""

    max_width: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # accepted + 1, per cycle
    verify_widths: list[int] = field(default_factory=list)  # the cycle's verify width W, per cycle
    # per source (dflash.width.SOURCES) and draft position k = 1..max_width-1: drafts of this
    # request's verified guesses that were scored (reached: every draft before them accepted)
    # and accepted; tried[s][k-1] counts position k
    tried: dict = field(default_factory=dict)
    accepted: dict = field(default_factory=dict)
    lookup_cycles: int = 0  # cycles whose draft was copied from the context (dflash.lookup)
    corpus_cycles: int = 0  # cycles whose draft came from the corpus (dflash.corpus)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verify cycle (accepted drafts + the bonus), in [1, max_width]."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    def record(self, width: int, source: str | None, own: int, num_accepted: int) -> None:
        """One cycle: verify width, the row's guess (its source, own drafts) and how many
        of them were accepted."""
        self.acceptance_lengths.append(num_accepted + 1)
        self.verify_widths.append(width)
        self.lookup_cycles += source == "lookup"
        self.corpus_cycles += source == "corpus"
        if source is not None and own:
            tried = self.tried.setdefault(source, [0] * (self.max_width - 1))
            accepted = self.accepted.setdefault(source, [0] * (self.max_width - 1))
            for k in range(min(num_accepted + 1, own)):
                tried[k] += 1
            for k in range(num_accepted):
                accepted[k] += 1

    def histogram(self) -> list[int]:
        """counts[i] = cycles that emitted i+1 tokens, i in 0..max_width-1."""
        counts = [0] * self.max_width
        for n in self.acceptance_lengths:
            counts[min(n, self.max_width) - 1] += 1
        return counts

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cycles": len(self.acceptance_lengths),
            "lookup_cycles": self.lookup_cycles,
            "corpus_cycles": self.corpus_cycles,
            "tau": round(self.tau, 4),
            "mean_verify_width": round(sum(self.verify_widths) / len(self.verify_widths), 3) if self.verify_widths else 0.0,
            "acceptance_lengths": list(self.acceptance_lengths),
            "acceptance_histogram": self.histogram(),
            "verify_widths": list(self.verify_widths),
            "prefill_time_s": round(self.prefill_time_s, 5),
            "draft_time_s": round(self.draft_time_s, 5),
            "verify_time_s": round(self.verify_time_s, 5),
            "total_time_s": round(self.total_time_s, 5),
            "tokens_per_s": round(self.generated_tokens / self.total_time_s, 3) if self.total_time_s > 0 else 0.0,
        }


@dataclass
class Request:
    """One sequence in flight: its parameters, output so far and statistics. `generator`
    is its own random stream: every uniform it consumes is drawn from it, never from a
    batch-wide one (dflash.sampling.row_uniforms)."""

    prompt_ids: list[int]
    params: SamplingParams
    stats: RequestStats
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    started: float = field(default_factory=time.perf_counter)
    lookup: NgramIndex | None = None  # prompt + output, for context lookup drafts
    width: RowWidth | None = None  # its acceptance and pending guesses (dflash.width), adaptive width only
    _position_uniforms: list[float] = field(default_factory=list, repr=False)

    def uniforms_at(self, start: int, n: int) -> list[float]:
        """The uniforms of output indices start .. start+n-1: the k-th of this request's
        stream belongs to its k-th output token, however many a cycle drafts or verifies
        (drawn 32 at a time, so the stream is the same whatever the access pattern). The
        match rule samples token k with it: a seeded request emits the same text whatever
        it drafts (alone, in any batch, at any width) - the text AR sampling gives."""
        while len(self._position_uniforms) < start + n:
            self._position_uniforms.extend(torch.rand(32, generator=self.generator).tolist())
        return self._position_uniforms[start:start + n]

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
    """Apply fn to every K and V tensor (b, heads, S, head_dim) of both caches."""
    for layer in batch.cache.layers:
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError("sliding-window target layers are not supported by DFlash decoding")
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)
    if batch.context is not None:
        batch.context = [(fn(k), fn(v)) for k, v in batch.context]


def select_rows(batch: DecodeBatch, rows: list[int]) -> DecodeBatch:
    """Keep only `rows`, in that order (e.g. drop finished requests)."""
    idx = torch.tensor(rows, dtype=torch.long, device=batch.slot_valid.device)
    _map_kv(batch, lambda x: x.index_select(0, idx.to(x.device)))
    return DecodeBatch(
        requests=[batch.requests[i] for i in rows], cache=batch.cache, context=batch.context,
        slot_valid=batch.slot_valid[idx], next_pos=batch.next_pos[idx], anchor=batch.anchor[idx])


def compaction_order(slot_valid: torch.Tensor) -> torch.Tensor:
    """slot_valid (b, S) -> order (b, S'): per row, the S' slots to keep, S' = the most
    valid slots of any row: all of the row's valid slots in sequence order, right-aligned,
    after some of its holes.

    Example (S = 5, S' = 3):
        slot_valid  [[1, 0, 1, 1, 0],      order  [[0, 2, 3],     kept valid  [[1, 1, 1],
                     [0, 0, 1, 0, 1]]  ->          [3, 2, 4]]  ->               [0, 1, 1]]
    A stable sort on valid puts each row's holes first and its valid slots last, both in
    slot order: row 1 sorts to [0, 1, 3 | 2, 4] and keeps the last three.
    """
    width = int(slot_valid.sum(1).max())
    return torch.sort(slot_valid.to(torch.int8), dim=1, stable=True).indices[:, slot_valid.shape[1] - width:]


def compact(batch: DecodeBatch) -> DecodeBatch:
    """Squeeze out holes: each row keeps its valid slots, in order, right-aligned in S'
    slots (compaction_order); positions are per row, so no result changes."""
    valid = batch.slot_valid
    order = compaction_order(valid)  # (b, S')
    width = order.shape[1]
    if width == valid.shape[1]:
        return batch

    def gather(x):  # x (b, h, S, d) -> (b, h, S', d)
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
