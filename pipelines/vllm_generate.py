"""engine: vllm for distillation's regeneration step: vLLM writes the responses, our
teacher-forced pass taps the features, so the Parquet rows are the same either way.

A VllmGenerator has dflash.regenerate.generate_batch's signature. It starts
dflash/vllm_worker.py in the vLLM venv once per distillation actor (start-up is most of a
small engine's cost) and sends each batch over the pipe. Greedy rows (fp32) are the
target's own greedy tokens under either engine; sampled rows are seeded per row, but vLLM
draws differently from our loop, so they are not the same samples.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash.regenerate import GenerationParams, row_seed
from dflash.vllm_env import VLLM_DTYPES, VllmUnavailable, start_worker, stop_worker


class VllmGenerator:
    """generate_batch(target, prompts, params, seed) -> responses, decoded by vLLM (AR)."""

    def __init__(self, target_dir: str | Path, dtype: str, max_model_len: int, max_num_seqs: int,
                 stop_token_ids: list[int], threads: int = 1, kv_cache_gib: int = 2, start_timeout_s: float = 900):
        if dtype not in VLLM_DTYPES:
            raise ValueError(f"engine vllm: dtype must be one of {sorted(VLLM_DTYPES)}, got {dtype!r}")
        self.stop_token_ids = list(stop_token_ids)
        spec = {"target": str(Path(target_dir).resolve()), "dtype": VLLM_DTYPES[dtype],
                "max_model_len": int(max_model_len), "max_num_seqs": int(max_num_seqs), "drafter": None}
        t0 = time.perf_counter()
        self._proc = start_worker(spec, threads, kv_cache_gib)
        line = self._proc.stdout.readline()  # the worker's first line: ready (or EOF if it died)
        if not line or json.loads(line).get("event") != "ready":
            self.close()
            raise VllmUnavailable(f"vLLM engine did not start (exit code {self._proc.poll()}); see the actor's stderr")
        self.startup_s = time.perf_counter() - t0
        self._batches = 0

    def __call__(self, target, prompts: list[list[int]], params: GenerationParams, seed: int = 0) -> list[list[int]]:
        self._batches += 1
        ids = [f"b{self._batches}-{i}" for i in range(len(prompts))]
        for rid, i, p in zip(ids, range(len(prompts)), prompts):
            self._send({"op": "generate", "id": rid, "prompt_ids": list(p), "max_tokens": params.max_new_tokens,
                        "temperature": params.temperature, "top_p": params.top_p,
                        "seed": row_seed(seed, i) if params.temperature > 0 else None,
                        "stop_token_ids": self.stop_token_ids})
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM engine exited (code {self._proc.wait()}) with {len(pending)} rows pending")
            msg = json.loads(line)
            if "error" in msg:
                raise RuntimeError(f"vLLM: {msg['error']}")
            out[msg["id"]] += msg["tokens"]
            if msg.get("finish"):
                pending.discard(msg["id"])
        return [out[rid] for rid in ids]

    def _send(self, msg: dict) -> None:
        self._proc.stdin.write(json.dumps(msg) + "\n")
        self._proc.stdin.flush()

    def close(self) -> None:
        stop_worker(self._proc)

    def __del__(self):
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
