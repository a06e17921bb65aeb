"""The end-to-end demo: every stage of dflash-ray, in order, on the embedded default target.

    dflash demo [--config jobs/configs/demo.yaml] [key=value ...]      # or: make demo

1. distill  Ray Data regenerates `samples` ShareGPT training conversations with the target
            and stores its tapped hidden states in Parquet          -> OUT/distill/
2. train    Ray Train + DeepSpeed trains a drafter on them for `train_steps` optimizer
            steps and exports it in the public DFlash layout        -> OUT/train/drafter/
3. bench    AR vs DFlash vs prompt lookup, side by side, at each temperature; greedy
            outputs re-checked (bf16: argmax rule; fp32: token for token)  -> OUT/bench/
4. serve    Ray Serve starts one target+drafter replica on 127.0.0.1 and answers one
            OpenAI chat request over real HTTP
Stages 3 and 4 use `drafter`: "default" (the reference drafter shipped for the target,
trained by this same pipeline at full size; a few hundred CPU steps cannot match it) or
"trained" (the one stage 2 just made).
Then it prints a summary (tau, speedup, lossless, where everything is) and writes it to
OUT/summary.json; plots are PNGs in OUT/.

Each stage reads only the previous stage's output on disk. Rerunning with the same config
resumes (distilled shards and training checkpoints are kept); an output directory that
holds a demo made with other settings, or anything else, is refused.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Literal

from dflash.config_file import config_to_dict
from dflash.pair import DecodeConfig

DEMO_RECORD = "demo.json"


@dataclass(frozen=True)
class DemoConfig(DecodeConfig):
    """Sizes that finish in ~10 minutes on 2 CPU cores (jobs/configs/demo.yaml).

    The decoding fields that stages 3 and 4 use (target, drafter, dtype, device, verify,
    block_size, lookup, lookup_tokens, corpus, tree_nodes) are dflash.pair.DecodeConfig's,
    so bench and the served replica decode with exactly the same settings."""

    STAGE: ClassVar[str] = "demo"

    # 3. bench and 4. serve: "default" (the shipped reference drafter) or "trained" (stage 2's)
    drafter: str = "default"
    output_dir: str = "demo_out"
    # 1. distill (fp32 on CPU: exact features, batching-invariant greedy tokens)
    samples: int = 48
    max_new_tokens: int = 96
    max_seq_len: int = 320  # prompt + response; longer ShareGPT prompts are skipped (prefill dominates)
    num_taps: int = 3
    distill_actors: int = 2  # one target per CPU core
    # 2. train
    train_steps: int = 300
    train_block_size: int = 8
    num_anchors: int = 32
    lr: float = 1e-3
    init: Literal["random", "target"] = "random"
    # 3. bench
    bench_dataset: str = "mt-bench"
    bench_prompts: int = 4
    bench_max_new_tokens: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    prompt_lookup: bool = True
    fp32_check_prompts: int = 2  # greedy prompts also decoded in fp32 and compared token for token
    # 4. serve
    port: int = 0  # 0: any free port on 127.0.0.1
    question: str = "Explain speculative decoding in two sentences."
    serve_max_tokens: int = 48

    def __post_init__(self):
        super().__post_init__()
        if self.drafter not in ("default", "trained"):
            raise ValueError(f"drafter must be 'default' (the shipped one) or 'trained' (stage 2's), "
                             f"got {self.drafter!r}")
        if self.max_seq_len <= self.max_new_tokens:
            raise ValueError(f"max_seq_len {self.max_seq_len} leaves no room for a prompt before "
                             f"max_new_tokens {self.max_new_tokens}")
        for name in ("samples", "max_new_tokens", "num_taps", "distill_actors", "train_steps", "num_anchors",
                     "bench_prompts", "bench_max_new_tokens", "serve_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.temperatures:
            raise ValueError("temperatures must name at least one temperature")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


def _say(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def claim_output_dir(cfg: DemoConfig) -> Path:
    """OUT must be new, empty, or a demo run with exactly these settings (then it resumes)."""
    out = Path(cfg.output_dir).expanduser().resolve()
    record = out / DEMO_RECORD
    mine = config_to_dict(cfg)
    if record.exists():
        old = json.loads(record.read_text()).get("config", {})
        diff = {k: (old.get(k), v) for k, v in mine.items() if old.get(k) != v}
        if diff:
            raise ValueError(f"{out} holds a demo run made with other settings {diff} (old, new): "
                             f"pass output_dir=<new dir> or delete it")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and holds something other than a demo run: pass output_dir=<new dir>")
    out.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"config": mine}, indent=1) + "\n")
    return out


# --- the four stages ---------------------------------------------------------------------

def distill(cfg: DemoConfig, out: Path) -> dict:
    from pipelines.distill import DistillConfig, run_distill

    return run_distill(DistillConfig(target=cfg.target, source="sharegpt", split="train", limit=cfg.samples,
                                     max_new_tokens=cfg.max_new_tokens, max_seq_len=cfg.max_seq_len, max_turns=1,
                                     num_taps=cfg.num_taps, num_actors=cfg.distill_actors,
                                     shard_size=max(1, min(16, cfg.samples // (2 * cfg.distill_actors))),
                                     output_dir=str(out / "distill")))


def train(cfg: DemoConfig, out: Path) -> dict:
    from jobs.report import plot_training
    from pipelines.train import METRICS_NAME, TrainConfig, run_train

    summary = run_train(TrainConfig(target=cfg.target, data=str(out / "distill"), output_dir=str(out / "train"),
                                    run_name="run", max_steps=cfg.train_steps, block_size=cfg.train_block_size,
                                    num_anchors=cfg.num_anchors, lr=cfg.lr, init=cfg.init,
                                    checkpoint_every=max(10, cfg.train_steps // 4)))
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / METRICS_NAME).read_text().splitlines() if line]
    summary["plot"] = str(plot_training(rows, out / "training.png"))
    return summary


def bench(cfg: DemoConfig, out: Path, drafter_dir: str) -> dict:
    """The bench table at each temperature, plus an fp32 token-for-token greedy check."""
    from dflash.bench import fp32_exact_check, run_bench
    from dflash.pair import load_pair
    from dflash.prompts import load_prompt_set
    from jobs.report import write_bench_report

    pair = load_pair(DecodeConfig.of(cfg, drafter=drafter_dir))
    target = pair.target
    prompts = [target.chat_ids(c) for c in load_prompt_set(cfg.bench_dataset)[: cfg.bench_prompts]]
    runs = []
    for temp in cfg.temperatures:
        _say(f"bench {cfg.bench_dataset} T={temp:g}: {len(prompts)} prompts, AR vs DFlash"
             + (" vs prompt lookup" if cfg.prompt_lookup else ""))
        r = run_bench(pair.decoder, prompts, max_new_tokens=cfg.bench_max_new_tokens, temperature=temp,
                      prompt_lookup=cfg.prompt_lookup,
                      progress=lambda i, n, row: _say(f"  prompt {i}/{n}: tau {row['tau']:.2f}"))
        runs.append({"dataset": cfg.bench_dataset, "target": target.target_id, "drafter": drafter_dir, **r})
    files = write_bench_report(runs, out / "bench")
    exact = None
    if cfg.fp32_check_prompts:
        _say(f"fp32 check: {cfg.fp32_check_prompts} greedy prompts, DFlash vs AR token for token")
        fp32 = load_pair(DecodeConfig.of(cfg, drafter=drafter_dir, dtype="fp32"))
        exact = fp32_exact_check(fp32.decoder, prompts[: cfg.fp32_check_prompts], cfg.bench_max_new_tokens)
    return {"runs": runs, "files": files, "fp32_exact": exact}


def serve_one_request(cfg: DemoConfig, drafter_dir: str) -> dict:
    """Start the Serve app, POST one chat completion, shut Serve down; the reply as JSON."""
    from ray import serve

    from serve.app import build_app
    from serve.config import ServeConfig

    port = cfg.port or free_port()
    scfg = ServeConfig(**asdict(DecodeConfig.of(cfg, drafter=drafter_dir)), port=port,
                       app_name="dflash-demo", min_replicas=1, max_replicas=1, num_cpus_per_replica=0.5)
    serve.start(http_options={"host": scfg.host, "port": port})
    try:
        serve.run(build_app(scfg), name=scfg.app_name, route_prefix="/")
        url = f"http://{scfg.host}:{port}/v1/chat/completions"
        body = {"model": scfg.app_name, "messages": [{"role": "user", "content": cfg.question}],
                "max_tokens": cfg.serve_max_tokens, "temperature": 0}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=300) as resp:
            reply = json.loads(resp.read())
        reply["latency_s"] = round(time.perf_counter() - t0, 3)
        reply["url"] = url
        return reply
    finally:
        serve.shutdown()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the run -----------------------------------------------------------------------------

def run_demo(cfg: DemoConfig) -> dict:
    """All four stages; returns (and writes to OUT/summary.json) the summary."""
    import ray

    from pipelines.ray_session import init_ray

    drafter_dir = None
    if cfg.drafter == "default":  # before any work: a target without a shipped drafter is refused
        from dflash.checkpoint import resolve_drafter
        from dflash.target import resolve_target_dir

        drafter_dir = str(resolve_drafter("default", resolve_target_dir(cfg.target)[1]))
    out = claim_output_dir(cfg)
    started_ray = not ray.is_initialized()
    if started_ray:  # one local Ray for every stage; actors and workers keep to one thread each
        init_ray(None)
    times, t0 = {}, time.perf_counter()
    try:
        _say(f"1/4 distill: {cfg.samples} ShareGPT conversations regenerated by {cfg.target} -> {out / 'distill'}")
        d = distill(cfg, out)
        times["distill_s"] = round(time.perf_counter() - t0, 1)
        _say(f"2/4 train: {cfg.train_steps} steps of a {cfg.train_block_size}-token-block drafter -> {out / 'train'}")
        t = train(cfg, out)
        times["train_s"] = round(time.perf_counter() - t0 - sum(times.values()), 1)
        drafter_dir = drafter_dir or t["drafter_dir"]
        _say(f"3/4 bench: autoregressive vs DFlash decoding of the same target, drafter {drafter_dir}")
        b = bench(cfg, out, drafter_dir)
        times["bench_s"] = round(time.perf_counter() - t0 - sum(times.values()), 1)
        _say("4/4 serve: one OpenAI chat request to a Ray Serve replica")
        reply = serve_one_request(cfg, drafter_dir)
        times["serve_s"] = round(time.perf_counter() - t0 - sum(times.values()), 1)
    finally:
        if started_ray:
            ray.shutdown()
    times["total_s"] = round(time.perf_counter() - t0, 1)
    summary = build_summary(cfg, out, d, t, b, reply, times, drafter_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(format_summary(summary), file=sys.stderr, flush=True)
    return summary


def build_summary(cfg, out: Path, d: dict, t: dict, b: dict, reply: dict, times: dict, drafter_dir: str) -> dict:
    greedy = [r for r in b["runs"] if r["temperature"] == 0]
    return {
        "output_dir": str(out),
        "target": cfg.target,
        "distill": {"samples": d["samples"], "tokens": d["tokens"], "dir": d["output_dir"]},
        "train": {"steps": t["steps"], "first_loss": t["first_loss"], "final_loss": t["final_loss"],
                  "final_accuracy": t["final_accuracy"], "drafter_dir": t["drafter_dir"]},
        "drafter": drafter_dir,  # what bench and serve ran
        "bench": [{k: r.get(k) for k in ("dataset", "temperature", "num_prompts", "tau", "ar_tokens_per_s",
                                         "dflash_tokens_per_s", "speedup", "lookup_cycle_fraction",
                                         "corpus_cycle_fraction", "prompt_lookup_speedup", "lossless",
                                         "lossless_rule")} for r in b["runs"]],
        "lossless": all(r["lossless"] for r in greedy) and b["fp32_exact"] is not False if greedy else None,
        "fp32_exact": b["fp32_exact"],
        "serve": {"url": reply["url"], "text": reply["choices"][0]["message"]["content"],
                  "finish_reason": reply["choices"][0]["finish_reason"], "usage": reply.get("usage"),
                  "dflash": reply.get("dflash"), "latency_s": reply["latency_s"]},
        "files": {"bench": b["files"], "training_plot": t["plot"], "summary": str(out / "summary.json")},
        "seconds": times,
    }


def format_summary(s: dict) -> str:
    lines = ["", "=" * 72, "dflash demo: summary", "=" * 72,
             f"distilled   {s['distill']['samples']} samples, {s['distill']['tokens']} tokens  ({s['distill']['dir']})",
             f"trained     {s['train']['steps']} steps, loss {s['train']['first_loss']:.3f} -> "
             f"{s['train']['final_loss']:.3f}  ({s['train']['drafter_dir']})"]
    for r in s["bench"]:
        pl = r["prompt_lookup_speedup"]
        lossless = {True: "lossless", False: "NOT LOSSLESS", None: "lossless in distribution (T>0)"}[r["lossless"]]
        lines.append(f"bench T={r['temperature']:g}   tau {r['tau']:.2f}, DFlash {r['dflash_tokens_per_s']:.1f} tok/s "
                     f"vs AR {r['ar_tokens_per_s']:.1f} tok/s = {r['speedup']:.2f}x"
                     + (f" (prompt lookup {pl:.2f}x)" if pl is not None else "") + f", {lossless}")
    if s["fp32_exact"] is not None:
        lines.append(f"fp32 check  DFlash greedy == AR greedy token for token: {'yes' if s['fp32_exact'] else 'NO'}")
    text = s["serve"]["text"].strip().replace("\n", " ")
    lines += [f"served      {s['serve']['url']} answered in {s['serve']['latency_s']:.1f} s: "
              f"{text[:160]}{'...' if len(text) > 160 else ''}",
              f"files       {s['files']['bench']['table']}, {s['files']['bench']['acceptance_plot']}, "
              f"{s['files']['training_plot']}, {s['files']['summary']}",
              "time        " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in s["seconds"].items()),
              "=" * 72]
    return "\n".join(lines)
