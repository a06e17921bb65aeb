"""Drafter training on real Ray Train + DeepSpeed with the real default target.

The distilled data is made here from the target's own greedy answers to eight chat
prompts (Parquet in the dflash.data contract, written with its writer), so these tests
do not depend on the distillation job. Sizes are tiny: the LM head over 49K rows per
scored block slot is what costs on CPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import start_local_ray
from dflash.data import DataMismatchError, DatasetMetadata, build_table, sample_id, write_shard
from dflash.decoding import SamplingParams, SpeculativeDecoder
from dflash.config_file import ConfigError, load_config
from dflash.training import round_to_storage, target_features, warmup_cosine
from pipelines.train import TrainConfig, check_cpu_budget, run_train
from support import CHAT_PROMPTS, chat_prompt_ids

REPO = Path(__file__).resolve().parents[1]
LAYERS = (1, 14, 27)
# small everything: 1 draft layer, block 8, 8 anchors, 2 sequences per micro-batch
TINY = dict(num_anchors=8, block_size=8, micro_batch_size=2, checkpoint_every=2, bucket_batches=2,
            lr=1e-3, warmup_ratio=0.0)


def _metadata(target, **changes) -> DatasetMetadata:
    meta = DatasetMetadata(target_id=target.target_id, weights_hash=target.weights_hash,
                           num_target_layers=target.num_layers, hidden_size=target.hidden_size,
                           target_layer_ids=LAYERS, features="taps", compute_dtype="fp32",
                           chat_template_hash=target.chat_template_hash())
    return dataclasses.replace(meta, **changes)


@pytest.fixture(scope="module")
def sequences(target_fp32):
    """(prompts, target greedy outputs, sample ids) for the eight chat prompts."""
    prompts = chat_prompt_ids(target_fp32, CHAT_PROMPTS)
    outs = SpeculativeDecoder(target_fp32).generate(prompts, SamplingParams(max_new_tokens=24))
    ids = [sample_id([{"role": "user", "content": q}]) for q in CHAT_PROMPTS]
    return prompts, [r.output_ids for r in outs], ids


def write_dataset(out: Path, target, sequences, meta: DatasetMetadata, rows=slice(None), shards: int = 2) -> Path:
    """Distilled shards: prompt + response tokens, loss on the response, fp16 taps."""
    prompts, outputs, sids = (x[rows] for x in sequences)
    seqs = [p + o for p, o in zip(prompts, outputs)]
    masks = [[0] * len(p) + [1] * len(o) for p, o in zip(prompts, outputs)]
    hidden = None
    if meta.features == "taps":
        hidden = []
        for s in seqs:
            t = torch.tensor([s])
            taps = target_features(target, t, torch.ones_like(t, dtype=torch.bool), meta.target_layer_ids)[0]
            hidden.append(round_to_storage(taps).numpy())
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(seqs) // shards)
    for i in range(0, len(seqs), per):
        h = hidden[i: i + per] if hidden is not None else None
        write_shard(build_table(meta, sids[i: i + per], seqs[i: i + per], masks[i: i + per], h),
                    out / f"part-{i // per:05d}.parquet")
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target_fp32, sequences) -> Path:
    return write_dataset(tmp_path_factory.mktemp("distilled"), target_fp32, sequences, _metadata(target_fp32))


def metrics_of(run_dir) -> list[dict]:
    return [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def steps_of(run_dir) -> list[dict]:
    return [r for r in metrics_of(run_dir) if "loss" in r]


# --- config and pure helpers -----------------------------------------------------------------

def test_shipped_configs_load_and_unknown_keys_are_errors():
    cpu = load_config(TrainConfig, REPO / "jobs/configs/train.yaml")
    gpu = load_config(TrainConfig, REPO / "jobs/configs/train_gpu.yaml")
    assert not cpu.use_gpu and cpu.num_workers >= 1
    assert gpu.use_gpu and gpu.precision == "bf16" and gpu.num_anchors == 512 and gpu.lr == 6e-4
    for path in ("train.yaml", "train_gpu.yaml"):
        assert "dflash train --config jobs/configs/" + path in (REPO / "jobs/configs" / path).read_text()
    with pytest.raises(ConfigError, match="learning_rate"):
        load_config(TrainConfig, None, ["learning_rate=1e-3"])
    with pytest.raises(ConfigError, match="zero_stage"):
        load_config(TrainConfig, None, ["zero_stage=4"])
    with pytest.raises(ConfigError, match="distill"):
        load_config(TrainConfig, REPO / "jobs/configs/distill.yaml")


def test_tap_scaling_trains_on_standardised_taps_and_folds_into_fc(target_fp32, sequences, data_dir):
    """fc'(taps * s) during training == fc(taps) after folding, so the exported drafter reads
    raw taps in the public layout; s makes every tap feature unit-RMS over the data."""
    from dflash.config import DrafterConfig
    from dflash.drafter import DFlashDrafter
    from dflash.objective import dflash_loss
    from dflash.training import DrafterObjective, fold_tap_scale, tap_rms_scale
    from pipelines.train_data import inspect_training_data
    from support import padded_batch

    info = inspect_training_data(str(data_dir), offline=True, target_id=target_fp32.target_id,
                                 weights_hash=target_fp32.weights_hash, num_target_layers=30, hidden_size=576,
                                 target_layer_ids=LAYERS)
    scale = torch.tensor(tap_rms_scale(info.files))
    prompts, outputs, _ = sequences
    ids, loss_mask, valid = padded_batch(prompts, outputs)
    taps = target_features(target_fp32, ids, valid, LAYERS)
    body = torch.cat([taps[i, 1: int(valid[i].sum())] for i in range(len(prompts))])
    rms = (body.half().float() * scale).pow(2).mean(0).sqrt()
    assert rms.min() > 0.99 and rms.max() < 1.01  # unit RMS per feature (the data's fp16 taps)
    assert scale.max() / scale.min() > 100  # massive activations: some features are 100x the others

    cfg = DrafterConfig.for_target(target_fp32, target_layer_ids=LAYERS,
                                   block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    objective = DrafterObjective(drafter, target_fp32, num_anchors=8, tap_scale=tuple(scale.tolist()))
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    scaled = objective(ids, loss_mask, taps, valid, g())
    folded = fold_tap_scale(drafter, scale)
    raw = dflash_loss(folded, target_fp32.embed, target_fp32.lm_head, ids, loss_mask, taps, valid, num_anchors=8,
                      generator=g())
    assert torch.allclose(scaled.loss, raw.loss, rtol=1e-4) and torch.equal(scaled.counts, raw.counts)


# --- bad input is refused before any worker starts --------------------------------------------

def _refused(tmp_path, data: Path, match: str, **overrides):
    cfg = TrainConfig(data=str(data), output_dir=str(tmp_path / "runs"), target_layer_ids=LAYERS, **overrides)
    with pytest.raises((DataMismatchError, ValueError, FileNotFoundError), match=match):
        run_train(cfg)
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_mismatched_or_empty_data_is_refused_naming_the_mismatch(tmp_path, target_fp32, sequences, data_dir):
    few = slice(0, 2)
    other_target = write_dataset(tmp_path / "t", target_fp32, sequences,
                                 _metadata(target_fp32, target_id="hf:Qwen3-8B"), few, 1)
    _refused(tmp_path, other_target, "target_id: data has 'hf:Qwen3-8B'")
    other_weights = write_dataset(tmp_path / "w", target_fp32, sequences,
                                  _metadata(target_fp32, weights_hash="0123456789abcdef"), few, 1)
    _refused(tmp_path, other_weights, "weights_hash")
    other_layers = write_dataset(tmp_path / "l", target_fp32, sequences,
                                 _metadata(target_fp32, target_layer_ids=(2, 15)), few, 1)
    _refused(tmp_path, other_layers, r"target_layer_ids: data has \[2, 15\], expected \[1, 14, 27\]")
    # the drafter asks for other layers than the data holds
    cfg = TrainConfig(data=str(data_dir), output_dir=str(tmp_path / "runs"), target_layer_ids=(3,))
    with pytest.raises(DataMismatchError, match=r"target_layer_ids: data has \[1, 14, 27\], expected \[3\]"):
        run_train(cfg)
    # hidden size: a dataset from a 64-wide model (the features are 3 x 64 wide)
    meta = _metadata(target_fp32, hidden_size=64)
    prompts, outputs, sids = sequences
    small = tmp_path / "h"
    small.mkdir()
    seq = prompts[0] + outputs[0]
    write_shard(build_table(meta, sids[:1], [seq], [[1] * len(seq)], [np.zeros((len(seq), 192), np.float16)]),
                small / "part-00000.parquet")
    _refused(tmp_path, small, "hidden_size: data has 64, expected 576")
    # a future format version
    future = tmp_path / "v"
    future.mkdir()
    vmeta = _metadata(target_fp32, format_version=99)
    write_shard(build_table(vmeta, sids[:1], [seq], [[1] * len(seq)], [np.zeros((len(seq), 1728), np.float16)]),
                future / "part-00000.parquet")
    _refused(tmp_path, future, "format version 99")
    # tokens-only data cannot train offline (it can online: see the online test)
    tokens = write_dataset(tmp_path / "n", target_fp32, sequences,
                           _metadata(target_fp32, features="none", target_layer_ids=()), few, 1)
    _refused(tmp_path, tokens, "features: data holds tokens only")
    # empty: a valid shard with no rows; and a directory with no shards at all
    empty = tmp_path / "e"
    empty.mkdir()
    pq.write_table(pa.Table.from_pylist([], schema=_metadata(target_fp32).schema()), empty / "part-00000.parquet")
    _refused(tmp_path, empty, "is empty: 1 shard")
    (tmp_path / "none").mkdir()
    _refused(tmp_path, tmp_path / "none", "no .parquet shards")
    _refused(tmp_path, tmp_path / "missing", "not found")
    # more workers x micro-batch than rows
    _refused(tmp_path, data_dir, "too few", num_workers=2, micro_batch_size=8)


def test_workers_that_leave_ray_data_no_cpu_are_refused_not_hung():
    """2 x 1 CPU on a 2-CPU machine used to hang in the parquet read; it is refused with a fix."""
    with pytest.raises(ValueError, match=r"leave 0 of the cluster's 2 CPUs .* cpus_per_worker \(e.g. to 0.5\)"):
        check_cpu_budget(TrainConfig(num_workers=2, cpus_per_worker=1.0), 2.0)
    with pytest.raises(ValueError, match="leave 0.2 of"):
        check_cpu_budget(TrainConfig(num_workers=2, cpus_per_worker=0.9), 2.0)
    check_cpu_budget(TrainConfig(num_workers=2, cpus_per_worker=0.5), 2.0)  # one CPU left for reads
    check_cpu_budget(TrainConfig(num_workers=1, cpus_per_worker=1.0), 2.0)
    check_cpu_budget(TrainConfig(num_workers=4, cpus_per_worker=1.0), 2.0)  # does not fit yet: autoscaling


# --- real training runs -----------------------------------------------------------------------

def test_two_workers_zero2_loss_goes_down_exports_and_decodes_losslessly(ray_session, tmp_path, data_dir,
                                                                          target_fp32, sequences):
    from dflash.checkpoint import load_drafter
    from jobs.cli import main as cli

    cfg = TrainConfig(data=str(data_dir), output_dir=str(tmp_path), run_name="z2", num_workers=2, zero_stage=2,
                      max_steps=8, init="target", eval_at_end=True, eval_num_prompts=2, eval_max_new_tokens=16,
                      tap_scaling="rms", decode_block_size=4, **(TINY | {"checkpoint_every": 4, "micro_batch_size": 1}))
    summary = run_train(cfg)
    steps = steps_of(summary["run_dir"])
    assert [r["step"] for r in steps] == list(range(1, 9)) and summary["steps"] == 8
    assert summary["workers"] == 2
    first, last = np.mean([r["loss"] for r in steps[:2]]), np.mean([r["loss"] for r in steps[-2:]])
    assert last < 0.6 * first, [r["loss"] for r in steps]
    for r in steps:  # per-position accuracy, the tau it implies, lr, throughput
        assert len(r["accuracy"]) == 7 and all(0 <= a <= 1 for a in r["accuracy"])
        assert r["implied_tau"] == pytest.approx(1 + np.cumprod(r["accuracy"]).sum(), abs=1e-3)
        assert r["tokens_per_s"] > 0 and r["tokens"] > 0
    assert steps[-1]["lr"] == pytest.approx(1e-3 * warmup_cosine(8, 0.0)(7))
    assert 1.0 <= steps[-1]["eval_tau"] <= 8.0 and summary["eval_tau"][0][0] == 8

    # the exported drafter (consolidated from 2 ZeRO-2 shards) loads in dflash/ and decodes
    # exactly what the target decodes alone
    drafter = load_drafter(summary["drafter_dir"], target=target_fp32)
    assert drafter.config.target_layer_ids == LAYERS and drafter.config.block_size == 8
    assert drafter.config.decode_block_size == 4 and SpeculativeDecoder(target_fp32, drafter).block_size == 4
    prompts = chat_prompt_ids(target_fp32, ["Name a color.", "What is 3+5?"])
    plain = SpeculativeDecoder(target_fp32).generate(prompts, SamplingParams(max_new_tokens=20))
    spec = SpeculativeDecoder(target_fp32, drafter).generate(prompts, SamplingParams(max_new_tokens=20))
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert all(r.stats.tau >= 1 for r in spec)

    # `dflash export RUN_DIR OUT_DIR` writes the same weights; it refuses to overwrite
    out = tmp_path / "exported"
    assert cli(["export", summary["run_dir"], str(out)]) == 0
    again = load_drafter(out)
    for (k, a), b in zip(drafter.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), k
    assert cli(["export", summary["run_dir"], str(out)]) == 2

    # rerunning the same run name resumes from the last checkpoint: no step is redone
    again = run_train(cfg)
    assert again["steps"] == 8 and again["resumes"] == 1
    assert [r["step"] for r in steps_of(summary["run_dir"])] == list(range(1, 9))
    with pytest.raises(ValueError, match="block_size"):  # same name, other drafter: refused
        run_train(dataclasses.replace(cfg, block_size=16))


def test_offline_and_online_give_the_same_first_step_loss(ray_session, tmp_path, data_dir, target_fp32, sequences):
    tokens_only = write_dataset(tmp_path / "tokens", target_fp32, sequences,
                                _metadata(target_fp32, features="none", target_layer_ids=()))
    first = {}
    for mode, data in (("offline", data_dir), ("online", tokens_only)):
        cfg = TrainConfig(data=str(data), output_dir=str(tmp_path / "runs"), run_name=mode, mode=mode,
                          target_layer_ids=LAYERS, max_steps=1, seed=3, **TINY)
        run_train(cfg)
        first[mode] = steps_of(cfg.run_dir)[0]
    assert first["online"]["tokens"] == first["offline"]["tokens"]
    assert first["online"]["loss"] == pytest.approx(first["offline"]["loss"], rel=1e-4)
    assert first["online"]["accuracy"] == first["offline"]["accuracy"]


def test_each_epoch_reads_the_shards_in_its_own_seeded_order(ray_session, tmp_path, target_fp32, sequences):
    import ray

    from pipelines.train_config import plan_run
    from pipelines.train_data import FILE_ORDERS, epoch_dataset_name, epoch_datasets, file_order

    data = write_dataset(tmp_path / "four", target_fp32, sequences,
                         _metadata(target_fp32, features="none", target_layer_ids=()), shards=4)
    cfg = TrainConfig(data=str(data), output_dir=str(tmp_path / "runs"), mode="online", target_layer_ids=LAYERS,
                      num_workers=1, max_steps=9, seed=5, **TINY)  # 4 steps an epoch: 3 epochs
    plan, info = plan_run(cfg)
    assert plan.steps_per_epoch == 4 and plan.file_orders == 3 <= FILE_ORDERS
    orders = [file_order(info.files, cfg.seed, k) for k in range(plan.file_orders)]
    assert orders[0] == list(info.files)  # epoch 0 reads file order
    assert all(sorted(o) == sorted(info.files) for o in orders) and len({tuple(o) for o in orders}) > 1
    assert orders == [file_order(info.files, cfg.seed, k) for k in range(3)]  # (seed, order) decides it
    assert file_order(info.files, cfg.seed + 1, 1) != orders[1] or file_order(info.files, cfg.seed + 1, 2) != orders[2]
    # each dataset streams its order's rows, read by real Ray Data: files concatenated in that order
    rows_of = {f: pq.read_table(f, columns=["input_ids"]).column("input_ids").to_pylist() for f in info.files}
    options = ray.data.DataContext.get_current().execution_options
    before, options.preserve_order = options.preserve_order, True  # as the training ingest sets it
    try:
        datasets = epoch_datasets(info, offline=False, seed=cfg.seed, orders=plan.file_orders)
        for epoch in range(5):
            want = [r for f in orders[epoch % 3] for r in rows_of[f]]
            got = [list(r["input_ids"]) for r in datasets[epoch_dataset_name(epoch, 3)].take_all()]
            assert got == want
    finally:
        options.preserve_order = before

def test_init_from_continues_a_drafter_keeping_its_weights_and_vocabulary(ray_session, tmp_path, target_fp32,
                                                                          sequences, data_dir):
    from dflash.checkpoint import load_drafter
    from pipelines.train_config import plan_run

    half = write_dataset(tmp_path / "half", target_fp32, sequences, _metadata(target_fp32), slice(0, 4), 1)
    common = dict(output_dir=str(tmp_path / "runs"), target_layer_ids=LAYERS, draft_vocab_size=256,
                  export_dtype="fp32")
    first = run_train(TrainConfig(data=str(half), run_name="first", max_steps=4, **common, **TINY))
    source = load_drafter(first["drafter_dir"])
    # continue on the full data at a vanishing learning rate: the weights stay the source's,
    # the draft vocabulary is the source's, not the one the full data would give
    cont = TrainConfig(data=str(data_dir), run_name="cont", max_steps=1, init_from=first["drafter_dir"],
                       **common, **(TINY | {"lr": 1e-9}))
    fresh_vocab = plan_run(dataclasses.replace(cont, init_from=None))[0].draft_vocab
    assert tuple(source.draft_vocab.tolist()) != fresh_vocab
    assert plan_run(cont)[0].draft_vocab == tuple(source.draft_vocab.tolist())
    summary = run_train(cont)
    continued = load_drafter(summary["drafter_dir"])
    for (name, a), b in zip(source.state_dict().items(), continued.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    # it starts where the source left off, not where a random drafter starts
    assert steps_of(summary["run_dir"])[0]["loss"] < 0.8 * steps_of(first["run_dir"])[0]["loss"]
    # a drafter of another shape, or a name that is no drafter, is refused before anything runs
    _refused(tmp_path / "a", data_dir, "num_hidden_layers", num_draft_layers=2, init_from=first["drafter_dir"],
             draft_vocab_size=256)
    _refused(tmp_path / "x", data_dir, "not a drafter directory", init_from=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="tap_scaling=none"):
        TrainConfig(init_from="default", tap_scaling="rms")


@pytest.mark.slow
def test_zero3_bf16_worker_failure_restarts_from_checkpoint(ray_session, tmp_path, data_dir, target_fp32, sequences):
    from dflash.checkpoint import load_drafter

    cfg = TrainConfig(data=str(data_dir), output_dir=str(tmp_path), run_name="z3", num_workers=2, zero_stage=3,
                      precision="bf16", max_steps=4, fail_at_step=3, eval_at_end=True, eval_num_prompts=1,
                      eval_max_new_tokens=8, draft_vocab_size=256, init="zero_output", **TINY)
    summary = run_train(cfg)
    rows = metrics_of(summary["run_dir"])
    # steps 1-3, the last rank dies after step 3, the group restarts from the step-2 checkpoint
    assert (tmp_path / "z3" / ".failed_at_3").exists()
    assert [r.get("step") for r in rows] == [1, 2, 3, 2, 3, 4]
    assert rows[3] == {"time": rows[3]["time"], "event": "resumed", "step": 2}
    assert summary["steps"] == 4 and summary["resumes"] == 1 and "eval_tau" in rows[-1]
    drafter = load_drafter(summary["drafter_dir"], target=target_fp32)  # consolidated from ZeRO-3 shards
    assert json.loads((Path(summary["drafter_dir"]) / "training.json").read_text())["step"] == 4
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    # the draft vocabulary (the 256 most frequent response tokens) survives sharding and export
    prompts, outputs, _ = sequences
    counts = torch.bincount(torch.tensor([t for o in outputs for t in o]), minlength=target_fp32.vocab_size)
    assert drafter.config.draft_vocab_size == 256 and drafter.draft_vocab.dtype == torch.long
    assert set(counts.nonzero().flatten().tolist()) <= set(drafter.draft_vocab.tolist())  # < 256 distinct here


@pytest.mark.slow
def test_one_run_spans_two_nodes(tmp_path, data_dir):
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the shared session; start_local_ray() brings it back afterwards
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": int(3e8)})
    cluster.add_node(num_cpus=2, object_store_memory=int(3e8))
    try:
        ray.init(address=cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu",
                                           "TOKENIZERS_PARALLELISM": "false"}})
        cluster.wait_for_nodes()
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        cfg = TrainConfig(data=str(data_dir), output_dir=str(tmp_path), run_name="spread", num_workers=2,
                          placement_strategy="STRICT_SPREAD", max_steps=2, **TINY)
        summary = run_train(cfg)
        assert summary["steps"] == 2 and summary["workers"] == 2 and summary["nodes"] == 2
    finally:
        ray.shutdown()
        cluster.shutdown()
        start_local_ray()
