"""Loopback load test of the Serve app: with the drafter vs without it (AR), in the same run.

    .venv/bin/python benchmarks/bench_serve.py --duration 30 --max-tokens 64 --concurrency 1,4,8 \
        [--long-prompt-tokens 4000] [--drafter DIR|default|random] [--torch-threads 1]

Starts a local Ray + Serve on 127.0.0.1, deploys one replica of the default config without
a drafter (plain autoregressive), loads it, deletes it, then the same with the drafter (by
default the shipped reference drafter with lookup, corpus and adaptive width: what
`dflash serve` runs), so the two never share the CPU. Each cell is a closed loop:
`concurrency` clients each send a greedy chat request, wait for the answer, send the next,
until the cell's stop time (requests still in flight then are awaited and counted). Prints
requests/s, output tokens/s and p50/p95 latency per cell, and the drafter's speedup over AR.

--long-prompt-tokens N adds one cell per mode: while `concurrency` (the first level) clients
send short requests (--short-tokens new tokens each), one client sends a prompt of N tokens
(max_tokens 1); the short requests' p50/p95 latency during that prefill, and the long
request's own latency, say whether chunked prefill keeps the replica responsive.
`--drafter random` measures the speculative overhead of a drafter that accepts ~nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import requests  # noqa: E402
from jobs.demo import free_port

PROMPTS = [
    "What is 2+2?", "Write a haiku about the sea.", "Name three primary colors.",
    "Explain gravity in one sentence.", "Give me a Python function that reverses a string.",
    "What is the capital of France?", "List four animals that live in the ocean.", "How do I boil an egg?",
]




def random_drafter_dir(target_spec: str, out: str, block_size: int) -> str:
    from dflash.checkpoint import save_drafter
    from dflash.config import DrafterConfig
    from dflash.drafter import DFlashDrafter
    from dflash.target import load_target

    target = load_target(target_spec, dtype="fp32")
    cfg = DrafterConfig.for_target(target, num_taps=3,
                                   block_size=block_size)
    return str(save_drafter(DFlashDrafter(cfg), out))


def long_prompt(tokens: int, target: str = "default") -> str:
    """A user message of `tokens` tokens of the target's tokenizer (numbered sentences, so
    nothing repeats exactly)."""
    from dflash.target import inspect_target

    tok = inspect_target(target).tokenizer
    text = " ".join(f"Note {i}: the river rose {i % 7} feet near mill {i % 13}." for i in range(tokens // 8))
    return tok.decode(tok(text, add_special_tokens=False)["input_ids"][:tokens])


def run_cell(url: str, concurrency: int, duration: float, max_tokens: int, long_tokens: int = 0,
             target: str = "default") -> dict:
    """Closed-loop load for `duration` seconds (with long_tokens: until the long prompt is
    answered, so every short request timed ran while it prefilled); returns the cell's figures."""
    stop_at = time.perf_counter() + duration
    long_out: dict = {}
    long_done = threading.Event()
    if long_tokens:
        text = long_prompt(long_tokens, target)

        def send_long():
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                    "temperature": 0}
            t0 = time.perf_counter()
            r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            long_out.update(status=r.status_code, latency_s=time.perf_counter() - t0,
                            prompt_tokens=r.json().get("usage", {}).get("prompt_tokens") if r.ok else None)
            long_done.set()
    else:
        long_done.set()
    latencies, tokens, taus, errors = [], [], [], []
    lock = threading.Lock()

    def client(k: int):
        i = k
        with requests.Session() as s:
            while not long_done.is_set() if long_tokens else time.perf_counter() < stop_at:
                body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        "max_tokens": max_tokens, "temperature": 0}
                t0 = time.perf_counter()
                r = s.post(f"{url}/v1/chat/completions", json=body, timeout=300)
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code != 200:
                        errors.append(r.status_code)
                        continue
                    out = r.json()
                    latencies.append(dt)
                    tokens.append(out["usage"]["completion_tokens"])
                    tau = (out.get("dflash") or {}).get("tau")  # engine vllm reports none per request
                    if tau is not None:
                        taus.append(tau)
                i += concurrency

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    if long_tokens:
        threads.append(threading.Thread(target=send_long))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    return {"requests": len(lat), "errors": len(errors), "wall_s": wall, "req_per_s": len(lat) / wall,
            "tok_per_s": sum(tokens) / wall, "p50_s": pct(0.50), "p95_s": pct(0.95),
            "tau": statistics.mean(taus) if taus else float("nan"), "long": long_out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default="auto",
                    help="auto/default: the shipped reference drafter; a drafter directory; random: an untrained one")
    ap.add_argument("--block-size", type=int, default=8, help="block size of the random drafter")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompt-tokens", type=int, default=0, help="add a long-prompt cell (e.g. 4000)")
    ap.add_argument("--short-tokens", type=int, default=16, help="new tokens of each short request in that cell")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of the one replica")
    ap.add_argument("--torch-threads", type=int, default=1, help="the replica's torch_threads (config default 1)")
    ap.add_argument("--engines", default="native", help="comma-separated: native, vllm (serve/vllm_engine.py)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a ServeConfig field for both modes, e.g. --set prefill_share=0.5 (repeatable)")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    from dflash.config_file import parse_override

    overrides = dict(parse_override(item) for item in args.set)

    import ray
    from ray import serve

    from serve.app import build_app
    from serve.config import ServeConfig

    from dflash.bench import cpu_description

    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    drafter = args.drafter
    if drafter == "random":
        drafter = random_drafter_dir(args.target, os.path.join(tmp, "drafter"), args.block_size)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": str(args.torch_threads), "TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1"}})
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        modes = [(engine, mode, path) for engine in args.engines.split(",")
                 for mode, path in (("no drafter", None), ("drafter", drafter))]
        for engine, mode, path in modes:
            mode = mode if engine == "native" else f"{engine} {mode}"
            slots = max(levels) + bool(args.long_prompt_tokens)  # the long prompt must not take a short one's slot
            cfg = ServeConfig(target=args.target, drafter=path, dtype=args.dtype, max_batch_size=slots, engine=engine,
                              max_ongoing_requests=2 * max(levels) + 1, num_cpus_per_replica=args.num_cpus,
                              torch_threads=args.torch_threads, max_context_tokens=None, app_name="bench",
                              max_queued_requests=64, **overrides)
            serve.run(build_app(cfg), name="bench", route_prefix="/")
            run_cell(url, 1, 0.1, 4)  # warm up
            for c in levels:
                rows.append({"mode": mode, "concurrency": c, **run_cell(url, c, args.duration, args.max_tokens)})
                print(f"  done: {mode} c={c}", file=sys.stderr, flush=True)
            if args.long_prompt_tokens:
                cell = run_cell(url, levels[0], args.duration, args.short_tokens, args.long_prompt_tokens, args.target)
                rows.append({"mode": mode, "concurrency": f"{levels[0]}+L", **cell})
                print(f"  done: {mode} long prompt {cell['long']}", file=sys.stderr, flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()

    cpu = cpu_description()
    print(f"\ncpu: {cpu['model']}, native bf16: {cpu['avx512_bf16'] or cpu['amx_bf16']}; replica: "
          f"{args.num_cpus} CPU, torch_threads {args.torch_threads}")
    print(f"target={args.target} dtype={args.dtype} drafter={args.drafter} {' '.join(args.set)} "
          f"max_tokens={args.max_tokens} duration={args.duration}s/cell")
    print(f"{'mode':<16} {'conc':>4} {'reqs':>5} {'err':>3} {'req/s':>7} {'out tok/s':>9} "
          f"{'p50 s':>7} {'p95 s':>7} {'tau':>5}")
    for r in rows:
        print(f"{r['mode']:<16} {r['concurrency']:>4} {r['requests']:>5} {r['errors']:>3} {r['req_per_s']:>7.2f} "
              f"{r['tok_per_s']:>9.1f} {r['p50_s']:>7.2f} {r['p95_s']:>7.2f} {r['tau']:>5.2f}")
    ar = {(r["mode"].replace("no drafter", "drafter"), r["concurrency"]): r for r in rows if "no drafter" in r["mode"]}
    for r in rows:
        base = ar.get((r["mode"], r["concurrency"]))
        if base is not None and base["tok_per_s"] > 0:
            print(f"{r['mode']} vs its AR at concurrency {r['concurrency']}: "
                  f"{r['tok_per_s'] / base['tok_per_s']:.2f}x output tokens/s")
    for r in rows:
        if r["long"]:
            print(f"{r['mode']}: {r['long'].get('prompt_tokens')}-token prompt answered in "
                  f"{r['long'].get('latency_s', float('nan')):.1f} s; short requests meanwhile p50 "
                  f"{r['p50_s']:.2f} s, p95 {r['p95_s']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
