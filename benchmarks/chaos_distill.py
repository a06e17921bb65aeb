"""Distillation under repeated kills: SIGKILL the whole driver (with its private Ray) at
random points, rerun, until a run completes; then check exactly-once against an
uninterrupted reference run.

    python benchmarks/chaos_distill.py --samples 24 --kills 4 --seed 0 [--json chaos.json]

The source is a .jsonl of `samples` distinct prompts plus two malformed lines. The
reference run distills it into ref/; the chaos runs distill the same config into chaos/,
each killed (process group, SIGKILL) at a random time, the last one left to finish. The
report: when each kill hit and how many shards were on disk then, and at the end rows,
distinct sample ids, planned samples, rejects, and whether every row's tokens equal the
reference's (fp32 greedy). Local only; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
RUN = ("import json, sys; from pipelines.distill import DistillConfig, run_distill; "
       "run_distill(DistillConfig(**json.loads(sys.argv[1])))")


def write_source(path: Path, n: int) -> None:
    topics = ["cats", "the sea", "Paris", "gravity", "bread", "rain", "chess", "music", "trees", "the moon",
              "bicycles", "tea", "snow", "volcanoes", "owls", "maps"]
    lines = [json.dumps({"prompt": f"Write one sentence about {topics[i % len(topics)]} (#{i})."}) for i in range(n)]
    lines.insert(n // 3, "this line is not json {")
    lines.insert(2 * n // 3, '{"messages": [{"role": "user", "content": "broken" oops}]}')
    path.write_text("\n".join(lines) + "\n")


def run(cfg: dict, kill_after: float | None) -> tuple[str, float]:
    """One driver process in its own session; SIGKILL its group after kill_after seconds."""
    env = dict(os.environ, RAY_ADDRESS="")
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-c", RUN, json.dumps(cfg)], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        proc.wait(timeout=kill_after)
        return ("completed" if proc.returncode == 0 else f"failed rc={proc.returncode}: {proc.stderr.read()[-500:]}",
                time.time() - t0)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(2)  # let the orphaned Ray processes notice their driver is gone
        return "killed", time.time() - t0


def rows(out: Path) -> dict:
    t = pq.read_table(out, columns=["sample_id", "input_ids"])
    return {"ids": t.column("sample_id").to_pylist(), "tokens": dict(zip(t.column("sample_id").to_pylist(),
                                                                          t.column("input_ids").to_pylist()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-kill-s", type=float, default=8)
    ap.add_argument("--max-kill-s", type=float, default=60)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="dflash-chaos-"))
    source = work / "prompts.jsonl"
    write_source(source, args.samples)
    base = dict(source=str(source), split="all", limit=0, max_new_tokens=8, max_turns=1, max_seq_len=256,
                shard_size=2, batch_size=2, num_actors=1, num_cpus_per_actor=1, dtype="fp32", num_taps=2,
                progress=False)
    status, ref_s = run(base | {"output_dir": str(work / "ref")}, None)
    assert status == "completed", status
    print(f"reference run: {ref_s:.0f} s", file=sys.stderr)
    chaos = base | {"output_dir": str(work / "chaos")}
    attempts = []
    for k in range(args.kills + 1):
        kill_after = rng.uniform(args.min_kill_s, args.max_kill_s) if k < args.kills else None
        status, took = run(chaos, kill_after)
        shards = len(list((work / "chaos").glob("part-*.parquet")))
        attempts.append({"attempt": k + 1, "kill_after_s": round(kill_after, 1) if kill_after else None,
                         "outcome": status, "seconds": round(took, 1), "shards_on_disk": shards})
        print(attempts[-1], file=sys.stderr)
        if status == "completed":
            break
    final = status
    while final != "completed":  # a kill landed after the run had finished its work: finish it
        final, _ = run(chaos, None)
        attempts.append({"attempt": len(attempts) + 1, "kill_after_s": None, "outcome": final})
    ref, got = rows(work / "ref"), rows(work / "chaos")
    manifest = json.loads((work / "chaos" / "_manifest.json").read_text())
    rejects = (work / "chaos" / "_rejects.jsonl").read_text().splitlines()
    report = {
        "samples_in_source": args.samples, "attempts": attempts,
        "kills": sum(a["outcome"] == "killed" for a in attempts),
        "rows": len(got["ids"]), "distinct_ids": len(set(got["ids"])), "reference_rows": len(ref["ids"]),
        "same_ids_as_reference": set(got["ids"]) == set(ref["ids"]),
        "tokens_equal_reference": got["tokens"] == ref["tokens"],
        "manifest_status": manifest["status"], "manifest_samples": manifest["samples"],
        "rejects_file_lines": len(rejects), "manifest_rejected": manifest["rejected"],
        "workdir": str(work),
    }
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    ok = (report["rows"] == report["distinct_ids"] == report["reference_rows"] == args.samples
          and report["same_ids_as_reference"] and report["tokens_equal_reference"]
          and report["rejects_file_lines"] == report["manifest_rejected"] == 2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
