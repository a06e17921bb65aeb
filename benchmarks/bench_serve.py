"""Loopback load test of the Serve app: with the drafter vs without it, in the same run.

    .venv/bin/python benchmarks/bench_serve.py --duration 20 --max-tokens 32 [--drafter runs/export/drafter]

Starts a local Ray + Serve on 127.0.0.1, deploys one replica without a drafter (plain
autoregressive), loads it, deletes it, then the same with the drafter, so the two never
share the CPU. Each cell is a closed loop: `concurrency` clients each send a greedy chat
request, wait for the answer, send the next, until the cell's stop time (requests still in
flight then are awaited and counted). Without --drafter a RANDOM drafter is made for the
target: its acceptance is ~1 token per cycle, so it measures the speculative overhead, not
a speedup. Prints requests/s, output tokens/s and p50/p95 latency per cell.
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


def run_cell(url: str, concurrency: int, duration: float, max_tokens: int) -> dict:
    """Closed-loop load for `duration` seconds; returns the cell's figures."""
    stop_at = time.perf_counter() + duration
    latencies, tokens, taus, errors = [], [], [], []
    lock = threading.Lock()

    def client(k: int):
        i = k
        with requests.Session() as s:
            while time.perf_counter() < stop_at:
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
                    taus.append(out["dflash"]["tau"])
                i += concurrency

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")  # noqa: E731
    return {"requests": len(lat), "errors": len(errors), "wall_s": wall, "req_per_s": len(lat) / wall,
            "tok_per_s": sum(tokens) / wall, "p50_s": pct(0.50), "p95_s": pct(0.95),
            "tau": statistics.mean(taus) if taus else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="default")
    ap.add_argument("--drafter", default=None, help="trained drafter directory (default: a random one)")
    ap.add_argument("--block-size", type=int, default=8, help="block size of the random drafter")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per cell")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs of the one replica")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    import ray
    from ray import serve

    from serve.app import build_app
    from serve.config import ServeConfig

    tmp = tempfile.mkdtemp(prefix="bench-serve-")
    drafter = args.drafter or random_drafter_dir(args.target, os.path.join(tmp, "drafter"), args.block_size)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                                       "HF_HUB_OFFLINE": "1"}})
    rows = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for mode, path in (("no drafter", None), ("drafter", drafter)):
            cfg = ServeConfig(target=args.target, drafter=path, dtype=args.dtype, max_batch_size=max(levels),
                              max_ongoing_requests=2 * max(levels), num_cpus_per_replica=args.num_cpus,
                              app_name="bench")
            serve.run(build_app(cfg), name="bench", route_prefix="/")
            run_cell(url, 1, 0.1, 4)  # warm up
            for c in levels:
                rows.append({"mode": mode, "concurrency": c, **run_cell(url, c, args.duration, args.max_tokens)})
                print(f"  done: {mode} c={c}", file=sys.stderr, flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"\ntarget={args.target} dtype={args.dtype} drafter={args.drafter or f'random (block {args.block_size})'} "
          f"max_tokens={args.max_tokens} duration={args.duration}s/cell")
    print(f"{'mode':<11} {'conc':>4} {'reqs':>5} {'err':>3} {'req/s':>7} {'out tok/s':>9} "
          f"{'p50 s':>7} {'p95 s':>7} {'tau':>5}")
    for r in rows:
        print(f"{r['mode']:<11} {r['concurrency']:>4} {r['requests']:>5} {r['errors']:>3} {r['req_per_s']:>7.2f} "
              f"{r['tok_per_s']:>9.1f} {r['p50_s']:>7.2f} {r['p95_s']:>7.2f} {r['tau']:>5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
