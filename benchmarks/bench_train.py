"""Training throughput with 1 and 2 workers, and held-out tau against training steps.

    HF_HUB_OFFLINE=1 DS_ACCELERATOR=cpu .venv/bin/python benchmarks/bench_train.py \
        --samples 16 --tput-steps 6 --tau-steps 24 --eval-every 8 --json bench_train.json

1. Data: `run_distill` on ShareGPT (default target, fp32, 3 taps), unless --data DIR is given.
2. Throughput: the same offline run (ZeRO-2, fp32) with 1 then 2 workers of 0.5 CPU each;
   tokens/s = real (non-padding) tokens per optimizer step over the step's wall time,
   summed over workers; the median over steps 2.. (step 1 and epoch starts include the
   Ray Data start-up, reported apart as wall seconds per step).
3. Held-out tau: one worker trains with init=random and again with init=target; every
   --eval-every steps rank 0 decodes the first --eval-prompts MT-Bench prompts greedily
   with the current drafter (true tau, not the implied one) next to the training loss.
On this 2-core machine two workers share the same two cores, so a second worker buys
little; on a cluster each worker has its own CPUs or GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "RAY_USAGE_STATS_ENABLED": "0",
               "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)


def distill(out: Path, samples: int) -> Path:
    from pipelines.distill import DistillConfig, run_distill

    run_distill(DistillConfig(limit=samples, max_new_tokens=64, num_taps=3, output_dir=str(out), progress=False,
                              shard_size=8))
    return out


def steps(run_dir: str) -> list[dict]:
    rows = [json.loads(l) for l in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=None, help="a distilled directory (default: distill --samples now)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--tput-steps", type=int, default=6)
    p.add_argument("--tau-steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--num-anchors", type=int, default=16)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from pipelines.ray_session import init_ray
    from pipelines.train import TrainConfig, run_train

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    ray = init_ray(num_cpus=4, log_to_driver=False, env_vars={"DS_ACCELERATOR": "cpu"})
    data = args.data or str(distill(work / "data", args.samples))
    base = dict(data=data, output_dir=str(work / "runs"), num_anchors=args.num_anchors, block_size=args.block_size,
                micro_batch_size=2, checkpoint_every=10_000, eval_at_end=False)
    result = {"data": data, "throughput": {}, "tau_vs_steps": {}}
    for workers in (1, 2):
        s = run_train(TrainConfig(run_name=f"tput-{workers}", num_workers=workers, max_steps=args.tput_steps, **base))
        rows = steps(s["run_dir"])
        result["throughput"][f"{workers}_workers"] = {
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in rows[1:]), 1),
            "step_seconds": [round(r["step_seconds"], 2) for r in rows],
            "pad_fraction": round(statistics.mean(r["pad_fraction"] for r in rows), 3)}
        print(json.dumps({f"{workers}_workers": result["throughput"][f"{workers}_workers"]}), flush=True)
    for init in ("random", "target"):
        s = run_train(TrainConfig(run_name=f"tau-{init}", init=init, max_steps=args.tau_steps,
                                  eval_every=args.eval_every, eval_num_prompts=args.eval_prompts,
                                  eval_max_new_tokens=32, warmup_ratio=0.04, **base))
        rows = steps(s["run_dir"])
        result["tau_vs_steps"][init] = [{"step": r["step"], "loss": round(r["loss"], 3),
                                         "implied_tau": round(r["implied_tau"], 3), "eval_tau": round(r["eval_tau"], 3)}
                                        for r in rows if "eval_tau" in r]
        print(json.dumps({init: result["tau_vs_steps"][init]}), flush=True)
    ray.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
