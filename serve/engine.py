"""Continuous batching around SpeculativeDecoder: requests join and leave between steps.

One asyncio task owns the decoder and the running batch. Each iteration:
  1. admit   waiting requests, up to max_batch_size in flight (running or prefilling), each
             as a chunked prefill (dflash.decoding.Prefill); run some prompt tokens of them,
             fewest remaining first (a short prompt never waits behind a long one); a
             request whose prefill completes emits its first token and merges into the
             running batch. The tokens an iteration prefills: prefill_chunk_tokens when no
             row is decoding. While rows decode, prefill gets `prefill_share` of the
             engine's time (an iteration prefills only when the prefill time so far is
             within that share of the decode time), and a chunk only as many tokens as fit
             prefill_slice_s at the measured prefill rate. So a long prompt prefills over
             many iterations in chunks large enough to run efficiently, while the running
             rows keep (1 - prefill_share) of the time and wait at most about one slice.
             (A chunk's cost grows with the context it attends to: at a 3000-token context
             a 16-token chunk costs as much as ~80 tokens at the start, so many tiny
             chunks would slow both.) A request cancelled mid-prefill is dropped before
             its next chunk;
  2. cancel  requests whose client left or whose stop string matched: finish_reason set,
             then drop_finished removes their rows;
  3. step    one speculative cycle for every row (ragged acceptance per row);
  4. deliver newly emitted tokens to each request's asyncio queue, drop finished rows.
Model work runs in the engine's own model thread (a one-worker executor) so the event loop
keeps accepting HTTP requests and streaming while a step computes. Being the engine's own,
a step never queues behind other users of the loop's default executor, and it is always
the same OS thread (torch's per-thread CPU state is set up once). Only the loop task
touches the batch; other coroutines only set flags (`cancel`) that the loop applies
between steps.

No Ray and no HTTP here: the engine is tested and benchmarked as plain asyncio.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from dflash.batch import DecodeBatch, Request, merge
from dflash.decoding import Prefill, SpeculativeDecoder
from dflash.sampling import SamplingParams

log = logging.getLogger(__name__)


class ContextTooLong(ValueError):
    """Prompt + max_new_tokens does not fit the context budget."""


@dataclass
class StepReport:
    """What one loop iteration did, for metrics."""

    batch_size: int  # rows in the speculative step
    waiting: int  # requests still queued after admission
    admitted: int
    draft_time_s: float
    verify_time_s: float
    acceptance_lengths: list[int]  # accepted + 1, one per row
    tokens: int  # tokens emitted by this iteration (first tokens of admitted ones included)
    width: int = 0  # the step's verify width (adaptive width: the one the policy chose; 0: no step)
    prefill_tokens: int = 0  # prompt tokens prefilled by this iteration


@dataclass
class EngineCounters:
    """What /health reports of the engine's life."""

    steps: int = 0
    max_batch_size_seen: int = 0


@dataclass
class Handle:
    """What a caller holds of one request, whichever engine decodes it: read `tokens()`,
    then `finish_reason`. The engine puts token lists, an error, then None on `events`."""

    prompt_ids: list[int]
    params: SamplingParams
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_reason: str | None = None
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    async def tokens(self) -> AsyncIterator[list[int]]:
        """Newly emitted token ids, as they come; raises if the engine failed this request."""
        while True:
            item = await self.events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


@dataclass
class Generation(Handle):
    """A request in this engine: its row's Request once prefilled, the batch sizes it saw."""

    request: Request | None = None
    batch_sizes: list[int] = field(default_factory=list)  # rows of each step it took part in

    @property
    def started(self) -> bool:
        """Its prefill finished (it left the queue and emitted its first token)."""
        return self.request is not None

    def stats(self) -> dict:
        """The speculative statistics of this request (the API's `dflash` extension)."""
        out = self.request.stats.to_dict() if self.request is not None else {}
        out["max_batch_size"] = max(self.batch_sizes, default=0)
        out["mean_batch_size"] = round(sum(self.batch_sizes) / len(self.batch_sizes), 3) if self.batch_sizes else 0.0
        return out


class BatchingEngine:
    """Owns a SpeculativeDecoder; decodes every submitted request in shared batched steps."""

    MIN_PREFILL_TOKENS = 16  # an iteration's prefill never shrinks below this (a long prompt always advances)

    def __init__(self, decoder: SpeculativeDecoder, max_batch_size: int = 8,
                 context_budget: int | None = None, on_step: Callable[[StepReport], None] | None = None,
                 prefill_chunk_tokens: int = 256, prefill_slice_s: float = 0.25, prefill_share: float = 0.3):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        if prefill_slice_s < 0:
            raise ValueError(f"prefill_slice_s must be >= 0, got {prefill_slice_s}")
        if not 0 < prefill_share <= 1:
            raise ValueError(f"prefill_share must be in (0, 1], got {prefill_share}")
        self.prefill_chunk_tokens = prefill_chunk_tokens  # prompt tokens per iteration at most
        self.prefill_slice_s = prefill_slice_s  # prefill time per iteration while rows decode (0: no cap)
        self.prefill_share = prefill_share  # of the engine's time while rows decode (1: every iteration)
        self._prefill_s_per_token: float | None = None  # measured: EMA over the chunks run
        self._prefill_credit_s = 0.0  # prefill time earned by decode steps and not yet spent
        self.decoder = decoder
        self.max_batch_size = max_batch_size
        self.context_budget = min(context_budget or decoder.max_positions, decoder.max_positions)
        self.on_step = on_step
        self.counters = EngineCounters()
        self._waiting: deque[Generation] = deque()
        self._running: list[Generation] = []  # row order of self._batch.requests
        self._prefilling: list[tuple[Generation, Prefill]] = []  # admitted, oldest first
        self._batch: DecodeBatch | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._reported_rows = 0  # batch size of the last StepReport
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-model")

    # --- the caller's side ----------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Queued requests still wanted (a cancelled one leaves the queue at the next iteration)."""
        return sum(1 for g in self._waiting if g.cancel_reason is None)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def describe(self) -> dict:
        """What /health reports of the engine."""
        return {"engine": "native", "block_size": self.decoder.block_size, "max_width": self.decoder.max_width}

    def room(self, prompt_len: int) -> int:
        """Largest max_new_tokens a prompt of this length may ask for (< 1: prompt too long)."""
        return self.context_budget - prompt_len - self.decoder.max_width

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Queue a request; the loop admits it at its next iteration."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if params.max_new_tokens > self.room(len(prompt_ids)):
            raise ContextTooLong(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_new_tokens} exceeds the context "
                f"budget of {self.context_budget} tokens")
        gen = Generation(list(prompt_ids), params)
        self._waiting.append(gen)
        self._ensure_loop()
        self._wakeup.set()
        return gen

    def cancel(self, gen: Generation, reason: str = "abort") -> None:
        """Stop a request (client gone: "abort"; stop string matched: "stop") at the next step."""
        if not gen.done and gen.cancel_reason is None:
            gen.cancel_reason = reason
            if self._wakeup is not None:
                self._wakeup.set()

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._model_thread.shutdown(wait=False)

    async def _in_model_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    # --- the loop -------------------------------------------------------------------------
    def _finish(self, gen: Generation, reason: str | None, error: BaseException | None = None) -> None:
        gen.finish_reason = reason or "abort"
        if error is not None:
            gen.events.put_nowait(error)
        gen.events.put_nowait(None)

    @property
    def num_prefilling(self) -> int:
        return len(self._prefilling)

    def _admit_now(self) -> list[Generation]:
        admitted = []
        while self._waiting and len(self._running) + len(self._prefilling) + len(admitted) < self.max_batch_size:
            gen = self._waiting.popleft()
            if gen.cancel_reason is not None:  # left before it started
                self._finish(gen, gen.cancel_reason)
            else:
                admitted.append(gen)
        return admitted

    def prefill_budget(self) -> int:
        """Prompt tokens this iteration may prefill: prefill_chunk_tokens, or while rows are
        decoding, what fits prefill_slice_s at the measured rate (at least MIN_PREFILL_TOKENS)."""
        if not self._running or not self.prefill_slice_s or self._prefill_s_per_token is None:
            return self.prefill_chunk_tokens
        fits = int(self.prefill_slice_s / self._prefill_s_per_token)
        return max(min(self.MIN_PREFILL_TOKENS, self.prefill_chunk_tokens), min(self.prefill_chunk_tokens, fits))

    def prefill_due(self) -> bool:
        """Whether this iteration prefills: always when no row decodes (or prefill_share is
        1), else when the prefill time earned by decode steps (prefill_share / (1 -
        prefill_share) of each step's time) covers what earlier chunks spent."""
        return not self._running or self.prefill_share >= 1 or self._prefill_credit_s >= 0

    def _account(self, decode_s: float = 0.0, prefill_s: float = 0.0) -> None:
        """Decode steps earn prefill time, chunks spend it; banked credit stays under one
        slice, so a long idle-from-prefill stretch does not buy a burst of chunks later."""
        if self.prefill_share >= 1:
            return
        earned = decode_s * self.prefill_share / (1 - self.prefill_share)
        self._prefill_credit_s = min(self._prefill_credit_s + earned - prefill_s, self.prefill_slice_s)

    def _prefill_some(self, budget: int) -> tuple[list[Generation], list[tuple[Generation, Exception]], int]:
        """Up to `budget` prompt tokens of the prefills, fewest remaining first (in a worker
        thread); the completed ones are merged into the batch. Once one has completed, only
        prefills that complete too follow in the same iteration: a short request that just
        finished its prefill decodes next instead of waiting for a long prompt's chunk.
        -> (completed, failed with their error, prompt tokens run)."""
        start, done, failed = budget, [], []
        self._prefilling.sort(key=lambda item: item[1].remaining_tokens)  # stable: ties stay oldest first
        while self._prefilling and budget > 0:
            gen, pf = self._prefilling[0]
            if done and pf.remaining_tokens > budget:  # a new row waits: its first step before a partial chunk
                break
            spend = min(budget, pf.remaining_tokens)
            try:
                t0 = time.perf_counter()
                new = pf.advance(budget)
                self._observe_prefill(spend, time.perf_counter() - t0)
                budget -= spend
                if new is None:
                    break
                merged = new if self._batch is None else merge(self._batch, new)
            except Exception as e:  # a bad prompt must not wedge the replica
                log.exception("prefill failed")
                self._prefilling.pop(0)
                failed.append((gen, e))
                continue
            self._prefilling.pop(0)
            self._batch = merged
            gen.request = new.requests[0]
            done.append(gen)
        return done, failed, start - budget

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.MIN_PREFILL_TOKENS:  # tiny chunks are mostly fixed cost: they would overstate it
            rate = seconds / tokens
            old = self._prefill_s_per_token
            self._prefill_s_per_token = rate if old is None else 0.7 * old + 0.3 * rate

    def _drop_cancelled_prefills(self) -> None:
        still = []
        for gen, pf in self._prefilling:
            if gen.cancel_reason is not None:  # left mid-prefill: no more chunks for it
                self._finish(gen, gen.cancel_reason)
            else:
                still.append((gen, pf))
        self._prefilling = still

    def _drop_finished(self) -> None:
        """Apply cancellations, remove finished rows, close their generations."""
        for gen in self._running:
            if gen.cancel_reason is not None and not gen.request.finished:
                gen.request.finish_reason = gen.cancel_reason
        if self._batch is None:
            return
        self._batch, _ = self.decoder.drop_finished(self._batch)
        still = []
        for gen in self._running:
            if gen.request.finished:
                self._finish(gen, gen.request.finish_reason)
            else:
                still.append(gen)
        self._running = still

    def _fail_running(self, error: BaseException) -> None:
        for gen in self._running:
            self._finish(gen, "abort", error)
        self._running, self._batch = [], None

    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting and not self._prefilling:
                if self._reported_rows:  # going idle: the batch-size gauge must read 0, not the last batch
                    self._report(0, 0, 0.0, 0.0, [], 0)
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            tokens = prefilled = 0
            admitted = self._admit_now()
            for gen in admitted:
                try:
                    self._prefilling.append((gen, self.decoder.start_prefill([gen.prompt_ids], [gen.params])))
                except ValueError as e:
                    self._finish(gen, "abort", RuntimeError(f"prefill failed: {e}"))
            self._drop_cancelled_prefills()
            if self._prefilling and self.prefill_due():
                t_prefill = time.perf_counter()
                completed, failed, prefilled = await self._in_model_thread(self._prefill_some, self.prefill_budget())
                self._account(prefill_s=time.perf_counter() - t_prefill if self._running else 0.0)
                for gen, e in failed:
                    self._finish(gen, "abort", RuntimeError(f"prefill failed: {e}"))
                for gen in completed:
                    gen.events.put_nowait(list(gen.request.output_ids))
                    tokens += len(gen.request.output_ids)
                self._running += completed
            self._drop_finished()
            if not self._running:
                self._report(0, len(admitted), 0.0, 0.0, [], tokens, prefilled=prefilled)
                continue
            first = self._batch.requests[0].stats
            draft0, verify0 = first.draft_time_s, first.verify_time_s
            t_step = time.perf_counter()
            try:
                emitted = await self._in_model_thread(self.decoder.step, self._batch)
            except Exception as e:
                log.exception("decoding step failed")
                self._fail_running(RuntimeError(f"decoding step failed: {e}"))
                continue
            if self._prefilling:  # only time that competes with a waiting prefill earns it credit
                self._account(decode_s=time.perf_counter() - t_step)
            rows = len(self._running)
            acceptance = []
            for gen, toks in zip(self._running, emitted):
                gen.batch_sizes.append(rows)
                acceptance.append(gen.request.stats.acceptance_lengths[-1])
                if toks:
                    gen.events.put_nowait(toks)
                    tokens += len(toks)
            self.counters.steps += 1
            self.counters.max_batch_size_seen = max(self.counters.max_batch_size_seen, rows)
            self._report(rows, len(admitted), first.draft_time_s - draft0, first.verify_time_s - verify0,
                         acceptance, tokens, first.verify_widths[-1], prefilled)
            self._drop_finished()

    def _report(self, rows, admitted, draft_s, verify_s, acceptance, tokens, width=0, prefilled=0) -> None:
        self._reported_rows = rows
        if self.on_step is not None:
            try:
                self.on_step(StepReport(rows, len(self._waiting), admitted, draft_s, verify_s, acceptance, tokens,
                                        width, prefilled))
            except Exception:  # metrics must never stop decoding
                log.exception("on_step callback failed")
