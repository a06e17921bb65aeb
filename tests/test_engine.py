"""The batching engine's chunked prefill (serve/engine.py, plain asyncio, no Ray, no HTTP):
a long prompt prefills a chunk per iteration while running rows keep decoding, a short
prompt never waits behind a long one, the time slice caps a chunk while rows decode, the
time share leaves decode steps between chunks, and a request cancelled mid-prefill stops
prefilling and frees the engine."""

import asyncio
import time

from dflash.decoding import SpeculativeDecoder
from dflash.sampling import SamplingParams
from serve.engine import BatchingEngine
from support import hf_greedy

LONG_TOKENS = 600


def _long_prompt(target) -> list[int]:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    ids = target.tokenizer(text, add_special_tokens=False)["input_ids"][:LONG_TOKENS]
    assert len(ids) == LONG_TOKENS
    return ids


def test_short_request_keeps_streaming_while_a_long_prompt_prefills(target_fp32):
    short = target_fp32.chat_ids([{"role": "user", "content": "Give me a Python function that reverses a string."}])
    long = _long_prompt(target_fp32)
    reports = []

    async def run():
        engine = BatchingEngine(SpeculativeDecoder(target_fp32), max_batch_size=4, on_step=reports.append,
                                prefill_chunk_tokens=32)
        s = engine.submit(short, SamplingParams(max_new_tokens=40))
        stream, long_first = [], None
        l_gen = None
        async for toks in s.tokens():
            stream.append((time.perf_counter(), len(toks)))
            if l_gen is None:  # the short one runs: now the long prompt arrives
                l_gen = engine.submit(long, SamplingParams(max_new_tokens=2))
        async for toks in l_gen.tokens():
            long_first = long_first or time.perf_counter()
        await engine.close()
        return s, l_gen, stream, long_first

    s, l_gen, stream, long_first = asyncio.run(run())
    assert s.request.output_ids == hf_greedy(target_fp32, short, 40)  # exact beside the chunks
    assert sum(n for _, n in stream) == len(s.request.output_ids) >= 30
    before_long = sum(n for t, n in stream if t < long_first)
    assert before_long >= 15, f"only {before_long} short tokens before the long prompt's first"
    assert l_gen.request.output_ids == hf_greedy(target_fp32, long, 2)  # chunked prefill is exact
    prefill_iterations = [r for r in reports if r.prefill_tokens]
    assert max(r.prefill_tokens for r in reports) <= 32 and len(prefill_iterations) >= LONG_TOKENS // 32
    assert any(r.prefill_tokens and r.batch_size for r in reports)  # decode steps between the chunks


def test_cancelled_long_prefill_frees_the_engine(target_fp32):
    long = _long_prompt(target_fp32)
    short = target_fp32.chat_ids([{"role": "user", "content": "What is 2+2?"}])
    reports = []

    async def run():
        engine = BatchingEngine(SpeculativeDecoder(target_fp32), max_batch_size=1, on_step=reports.append,
                                prefill_chunk_tokens=32)
        l_gen = engine.submit(long, SamplingParams(max_new_tokens=4))
        while not any(r.prefill_tokens for r in reports):  # the first chunk ran
            await asyncio.sleep(0.01)
        engine.cancel(l_gen)
        s = engine.submit(short, SamplingParams(max_new_tokens=8))  # max_batch_size 1: waits for the slot
        out = [t async for toks in s.tokens() for t in toks]
        await engine.close()
        return l_gen, s, out, engine

    l_gen, s, out, engine = asyncio.run(run())
    assert l_gen.finish_reason == "abort" and l_gen.request is None  # never finished its prefill
    assert out == hf_greedy(target_fp32, short, 8)
    assert sum(r.prefill_tokens for r in reports) < LONG_TOKENS // 2  # the rest of the long prompt never ran
    assert engine.num_prefilling == engine.num_running == engine.num_waiting == 0


def test_short_prompt_is_not_queued_behind_a_long_prefill(target_fp32):
    long = _long_prompt(target_fp32)
    short = target_fp32.chat_ids([{"role": "user", "content": "What is 2+2?"}])
    reports = []

    async def run():
        engine = BatchingEngine(SpeculativeDecoder(target_fp32), max_batch_size=4, prefill_chunk_tokens=64,
                                on_step=reports.append)
        l_gen = engine.submit(long, SamplingParams(max_new_tokens=2))
        s_gen = engine.submit(short, SamplingParams(max_new_tokens=8))  # arrives second, prefills first
        firsts = {}

        async def read(name, gen):
            out = []
            async for toks in gen.tokens():
                firsts.setdefault(name, time.perf_counter())
                out += toks
            return out

        l_out, s_out = await asyncio.gather(read("long", l_gen), read("short", s_gen))
        await engine.close()
        return l_out, s_out, firsts

    l_out, s_out, firsts = asyncio.run(run())
    assert firsts["short"] < firsts["long"]
    # the short prompt's prefill completed alone: the rest of the chunk's budget did not go
    # to the long prompt before the short row's first step
    assert reports[0].prefill_tokens == len(short) < 64
    assert s_out == hf_greedy(target_fp32, short, 8) and l_out == hf_greedy(target_fp32, long, 2)


def test_prefill_slice_caps_prompt_tokens_while_rows_decode(target_fp32):
    short = target_fp32.chat_ids([{"role": "user", "content": "Give me a Python function that reverses a string."}])
    long = _long_prompt(target_fp32)
    reports = []

    async def run():
        # a slice far below one token's prefill time: while the short row decodes, every
        # iteration prefills the floor (MIN_PREFILL_TOKENS); once it is done, whole chunks
        engine = BatchingEngine(SpeculativeDecoder(target_fp32), max_batch_size=4, on_step=reports.append,
                                prefill_chunk_tokens=128, prefill_slice_s=1e-9, prefill_share=1.0)
        s = engine.submit(short, SamplingParams(max_new_tokens=24))
        l_gen = None
        async for _ in s.tokens():
            if l_gen is None:
                l_gen = engine.submit(long, SamplingParams(max_new_tokens=2))
        l_out = [t async for toks in l_gen.tokens() for t in toks]
        await engine.close()
        return s, l_out

    s, l_out = asyncio.run(run())
    assert s.request.output_ids == hf_greedy(target_fp32, short, 24) and l_out == hf_greedy(target_fp32, long, 2)
    beside_rows = [r.prefill_tokens for r in reports if r.prefill_tokens and r.batch_size]
    alone = [r.prefill_tokens for r in reports if r.prefill_tokens and not r.batch_size]
    floor = BatchingEngine.MIN_PREFILL_TOKENS
    # the first and the last are the short's own prefill and the long's final chunk (a
    # completed prefill's row steps in its own iteration); every chunk between ran beside rows
    assert len(beside_rows) > 10 and max(beside_rows[1:-1]) <= floor
    assert alone and max(alone) == 128


def test_prefill_share_accounting():
    """Decode steps earn share / (1 - share) of their time for prefill, chunks spend it, and
    the bank never holds more than one slice."""
    engine = BatchingEngine.__new__(BatchingEngine)
    engine.prefill_share, engine.prefill_slice_s, engine._prefill_credit_s = 0.3, 0.25, 0.0
    engine._running = [object()]  # a row is decoding
    assert engine.prefill_due()
    engine._account(prefill_s=0.2)
    assert not engine.prefill_due() and abs(engine._prefill_credit_s + 0.2) < 1e-12
    engine._account(decode_s=0.3)  # earns 0.3 * 0.3 / 0.7 = 0.1286
    assert not engine.prefill_due()
    engine._account(decode_s=0.2)  # earns 0.0857: back above zero
    assert engine.prefill_due() and abs(engine._prefill_credit_s - (-0.2 + 0.5 * 3 / 7)) < 1e-9
    engine._account(decode_s=100.0)
    assert engine._prefill_credit_s == 0.25
    engine._running = []  # nothing decodes: prefill is always due
    engine._prefill_credit_s = -5.0
    assert engine.prefill_due()
    engine.prefill_share, engine._running = 1.0, [object()]
    assert engine.prefill_due()


def test_prefill_share_leaves_decode_steps_between_chunks(target_fp32):
    """With a share below 1, a chunk that ran beside decoding rows is followed by
    decode-only iterations (the rows get their share back) before the next chunk."""
    short = target_fp32.chat_ids([{"role": "user", "content": "Give me a Python function that reverses a string."}])
    long = _long_prompt(target_fp32)
    reports = []

    async def run():
        engine = BatchingEngine(SpeculativeDecoder(target_fp32), max_batch_size=4, on_step=reports.append,
                                prefill_chunk_tokens=128, prefill_slice_s=10.0, prefill_share=0.2)
        s = engine.submit(short, SamplingParams(max_new_tokens=40))
        l_gen = None
        async for _ in s.tokens():
            if l_gen is None:
                l_gen = engine.submit(long, SamplingParams(max_new_tokens=2))
        l_out = [t async for toks in l_gen.tokens() for t in toks]
        await engine.close()
        return s, l_out

    s, l_out = asyncio.run(run())
    assert s.request.output_ids == hf_greedy(target_fp32, short, 40) and l_out == hf_greedy(target_fp32, long, 2)
    beside = [i for i, r in enumerate(reports) if r.prefill_tokens == 128 and r.batch_size]
    assert len(beside) >= 2  # the long prompt's chunks ran while the short row decoded
    for a, b in zip(beside, beside[1:]):
        between = reports[a + 1: b]
        assert between and all(r.batch_size and not r.prefill_tokens for r in between)
