"""Drafter training on Ray Train + DeepSpeed: the driver.

    dflash train --config jobs/configs/train.yaml [key=value ...]
    dflash export RUN_DIR OUT_DIR

`run_train` checks everything it can before a worker starts (pipelines.train_config.plan_run:
the config, the target's tokenizer and shape, the distilled data's metadata against the
drafter; other target, layer ids, hidden size or format version are refused, an empty
dataset is an error), claims the run directory, then a TorchTrainer runs
pipelines.train_worker on N workers and the final drafter is exported (pipelines.export).

    pipelines/train_config.py  TrainConfig, TrainPlan, plan_run, the run directory
    pipelines/train_data.py    the data check, Ray Data reading, length-bucketed micro-batches
    pipelines/train_worker.py  the per-worker loop (setup / train_epoch / evaluate / save)
    pipelines/export.py        ZeRO shards -> one drafter in the public layout
    dflash/training.py         the Ray-free pieces: objective, init, draft vocabulary, features

Rerunning the same run name resumes from its latest checkpoint; a worker failure restarts
the worker group from it (max_failures times).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipelines.export import export_run
from pipelines.ray_session import init_ray
from pipelines.train_config import METRICS_NAME, TrainConfig, TrainPlan, claim_run_dir, plan_run
from pipelines.train_data import epoch_datasets
from pipelines.train_worker import train_loop_per_worker


def check_cpu_budget(cfg: TrainConfig, cluster_cpus: float) -> None:
    """Ray Train hands Ray Data only the CPUs its workers leave over. When the workers fit
    but leave less than one CPU, the parquet read never gets scheduled and the run hangs
    silently (e.g. 2 workers x 1 CPU on a 2-CPU machine), so refuse that up front. A
    cluster too small for the workers is left alone: Ray Train waits for autoscaling."""
    needed = cfg.num_workers * cfg.cpus_per_worker
    if needed <= cluster_cpus < needed + 1:
        raise ValueError(
            f"{cfg.num_workers} workers x {cfg.cpus_per_worker:g} CPU leave {cluster_cpus - needed:g} of the "
            f"cluster's {cluster_cpus:g} CPUs for Ray Data's parquet reads, which need 1; lower "
            f"cpus_per_worker (e.g. to {max(0.1, (cluster_cpus - 1) / cfg.num_workers):.2g}) or num_workers")


def ordered_ingest():
    """Rows reach the workers in the order of their epoch's files, so the same data and
    seed give the same micro-batches (and losses) run after run and in both modes;
    shuffling is per-epoch file orders plus local, seeded buckets (pipelines.train_data)."""
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return DataConfig(execution_options=options)


def run_train(cfg: TrainConfig) -> dict:
    """Train (or resume) cfg.run_name; export the final drafter; return a summary."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    t0 = time.perf_counter()
    plan, data = plan_run(cfg)
    ray = init_ray(cfg.ray_address)
    check_cpu_budget(cfg, ray.cluster_resources().get("CPU", 0.0))
    claim_run_dir(cfg)
    env = {"OMP_NUM_THREADS": str(max(1, int(cfg.cpus_per_worker))), "TOKENIZERS_PARALLELISM": "false"}
    if not cfg.use_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    resources = {"CPU": cfg.cpus_per_worker} | ({"GPU": 1} if cfg.use_gpu else {})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg, "plan": plan},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=resources, placement_strategy=cfg.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        datasets=epoch_datasets(data, cfg.offline, cfg.seed, plan.file_orders),
        dataset_config=ordered_ingest(),
        run_config=RunConfig(name=cfg.run_name, storage_path=str(cfg.run_dir.parent),
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                             worker_runtime_env={"env_vars": env}),
    )
    trainer.fit()
    drafter_dir = export_run(cfg.run_dir, cfg.run_dir / "drafter", dtype=cfg.export_dtype, overwrite=True)
    summary = summarize(cfg, plan, drafter_dir, time.perf_counter() - t0)
    print(json.dumps({k: summary[k] for k in ("steps", "first_loss", "final_loss", "final_implied_tau")}),
          file=sys.stderr)
    return summary


def summarize(cfg: TrainConfig, plan: TrainPlan, drafter_dir: Path, seconds: float) -> dict:
    rows = [json.loads(l) for l in (cfg.run_dir / METRICS_NAME).read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in steps if "eval_tau" in r]
    last = steps[-1] if steps else {}
    return {
        "run_dir": str(cfg.run_dir), "drafter_dir": str(drafter_dir), "steps": last.get("step", 0),
        "total_steps": plan.total_steps, "steps_per_epoch": plan.steps_per_epoch,
        "first_loss": steps[0]["loss"] if steps else None, "final_loss": last.get("loss"),
        "final_accuracy": last.get("accuracy"), "final_implied_tau": last.get("implied_tau"),
        "eval_tau": [(r["step"], r["eval_tau"]) for r in evals],
        "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / len(steps) if steps else 0.0,
        "resumes": sum(1 for r in rows if r.get("event") == "resumed"),  # restarts after failures + reruns
        "workers": last.get("workers"), "nodes": last.get("nodes"), "seconds": round(seconds, 1),
    }
