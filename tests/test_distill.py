"""Distillation: the data contract, and the Ray Data job on a real local cluster with the
real default target. Crash tests kill a real actor process, a real driver process and a
real node, then rerun and check that every accepted sample is in the output exactly once
(and that greedy tokens are identical to an uninterrupted run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import _RAY_TMP as RAY_TMP, start_local_ray
from dflash.data import (DUPLICATE, EMPTY, MALFORMED, MANIFEST_NAME, NON_TEXT, REJECTS_NAME, TOO_LONG,
                         DataMismatchError, DatasetMetadata, Reject, build_table, check_dataset, distill_schema,
                         hidden_arrays, normalize_conversation, read_dataset_metadata, sample_id, split_of,
                         write_shard)
from dflash.sources import iter_records
from pipelines.distill import DistillConfig, DistillConfigError, plan_samples, run_distill

REPO = Path(__file__).resolve().parents[1]

GOOD = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"prompt": "Write one sentence about cats."},
    {"conversations": [{"from": "human", "value": "Hi! Who are you?"}, {"from": "gpt", "value": "an old answer"},
                       {"from": "human", "value": "Tell me a fun fact."}]},
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three fruits."}]},
    {"prompt": "Count from one to five."},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Explain gravity simply."}]}]},
    {"prompt": "What is 12 times 12?"},
    {"messages": [{"role": "user", "content": "Give me a synonym for happy."},
                  {"role": "assistant", "content": "Joyful."}, {"role": "user", "content": "And one for sad?"}]},
]
BAD = [  # (raw JSONL line, expected reason)
    ("this is not json {", MALFORMED),
    ("[1, 2, 3]", MALFORMED),
    (json.dumps({"messages": [{"role": "robot", "content": "beep"}]}), MALFORMED),
    (json.dumps({"conversations": []}), EMPTY),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), NON_TEXT),
    (json.dumps({"prompt": "word " * 700}), TOO_LONG),
    (json.dumps({"conversations": [{"from": "human", "value": "What is the capital of France?"}]}), DUPLICATE),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A JSONL source mixing every layout with every kind of bad record."""
    lines = []
    for i, rec in enumerate(GOOD):
        lines.append(json.dumps(rec))
        if i < len(BAD):
            lines.append(BAD[i][0])
    path = tmp_path_factory.mktemp("src") / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_cfg(source: Path, out: Path, **kw) -> DistillConfig:
    base = dict(source=str(source), split="all", limit=0, max_new_tokens=16, max_turns=2, max_seq_len=512,
                shard_size=2, batch_size=2, num_actors=1, num_cpus_per_actor=1, dtype="fp32",
                output_dir=str(out), progress=False)
    return DistillConfig(**(base | kw))


def read_rows(out: Path) -> dict[str, dict]:
    table = pq.read_table(out)  # plain pyarrow over the whole directory
    return {r["sample_id"]: r for r in table.select(["sample_id", "input_ids", "loss_mask"]).to_pylist()}


def assert_exactly_once(out: Path, reference: dict[str, dict]) -> None:
    ids = pq.read_table(out, columns=["sample_id"]).column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "a sample was written twice"
    assert set(ids) == set(reference), "samples missing or unexpected"
    rows = read_rows(out)
    assert all(rows[k]["input_ids"] == reference[k]["input_ids"] for k in reference), "greedy tokens differ"


@pytest.fixture(scope="module")
def distilled(source, tmp_path_factory):
    """The reference run: every test reads it, the crash tests compare against it."""
    start_local_ray()
    out = tmp_path_factory.mktemp("distilled") / "out"
    summary = run_distill(make_cfg(source, out))
    return out, summary


# --- the data contract, no Ray ----------------------------------------------------------------

def test_normalisation_and_sample_ids_are_layout_independent():
    a = normalize_conversation({"messages": [{"role": "user", "content": "hi"}]})
    b = normalize_conversation({"conversations": [{"from": "human", "value": "hi"}]})
    c = normalize_conversation({"prompt": "hi"})
    assert a == b == c == [{"role": "user", "content": "hi"}]
    assert sample_id(a) == sample_id(c) and len(sample_id(a)) == 32
    assert sample_id(a) != sample_id([{"role": "user", "content": "hi!"}])
    merged = normalize_conversation({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]})
    assert merged == [{"role": "user", "content": "a\n\nb"}]
    for raw, reason in [(3, MALFORMED), ({"x": 1}, MALFORMED), ({"messages": []}, EMPTY),
                        ({"messages": [{"role": "user", "content": "  "}]}, EMPTY),
                        ({"prompt": 5}, NON_TEXT)]:
        with pytest.raises(Reject) as e:
            normalize_conversation(raw)
        assert e.value.reason == reason


def test_split_is_deterministic_and_about_the_asked_fraction():
    ids = [sample_id([{"role": "user", "content": str(i)}]) for i in range(4000)]
    held = [split_of(s, 0.1) == "heldout" for s in ids]
    assert held == [split_of(s, 0.1) == "heldout" for s in ids]
    assert 0.07 < sum(held) / len(held) < 0.13


def test_table_round_trip_and_mismatch_messages(tmp_path):
    meta = DatasetMetadata("t", "w", 4, 3, (1, 2), "taps", "fp32", "h", {"max_new_tokens": 2})
    hidden = [np.arange(3 * 6, dtype=np.float16).reshape(3, 6), np.ones((1, 6), np.float16)]
    table = build_table(meta, ["a", "b"], [[1, 2, 3], [4]], [[0, 1, 1], [1]], hidden)
    assert table.schema.equals(distill_schema(6), check_metadata=False)
    write_shard(table, tmp_path / "part-00000.parquet")
    back = pq.read_table(tmp_path)
    assert [h.tolist() for h in hidden_arrays(back)] == [h.tolist() for h in hidden]
    assert read_dataset_metadata(tmp_path) == meta
    with pytest.raises(DataMismatchError, match=r"target_layer_ids: data has \[1, 2\], expected \[1, 3\]"):
        check_dataset(tmp_path, target_layer_ids=[1, 3])
    with pytest.raises(DataMismatchError, match="hidden_size"):
        check_dataset(tmp_path, target_id="t", hidden_size=4)


def test_sharegpt_wheel_streams_and_plans_quickly(target_fp32):
    first = next(iter(iter_records("sharegpt")))
    assert "conversations" in first
    plan = plan_samples(DistillConfig(limit=5), target_fp32.tokenizer)
    assert len(plan.samples) == 5 and all(split_of(s["sample_id"], 0.02) == "train" for s in plan.samples)


def test_bad_configuration_fails_at_start(tmp_path, source):
    from dflash.config_file import ConfigError, load_config

    with pytest.raises(ConfigError, match="unknown key"):
        load_config(DistillConfig, REPO / "jobs/configs/distill.yaml", ["bogus=1"])
    with pytest.raises(DistillConfigError, match="unknown target"):
        run_distill(make_cfg(source, tmp_path / "a", target="no-such-model"))
    with pytest.raises(DistillConfigError, match=r"out of range.*30 layers"):
        run_distill(make_cfg(source, tmp_path / "b", target_layer_ids=(1, 30)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(DistillConfigError, match="not writable"):
        run_distill(make_cfg(source, tmp_path / "file" / "out"))
    with pytest.raises(ValueError, match="num_gpus_per_actor"):
        DistillConfig(device="cuda")


def test_shipped_configs_load():
    from dflash.config_file import load_config

    cpu = load_config(DistillConfig, REPO / "jobs/configs/distill.yaml")
    gpu = load_config(DistillConfig, REPO / "jobs/configs/distill_gpu.yaml")
    assert cpu.device == "cpu" and gpu.num_gpus_per_actor == 1 and gpu.min_actors < gpu.max_actors
    for name in ("distill.yaml", "distill_gpu.yaml"):
        assert "dflash distill --config jobs/configs/" + name in (REPO / "jobs/configs" / name).read_text()


# --- the job ------------------------------------------------------------------------------------

def test_schema_metadata_manifest_and_plain_pyarrow(distilled, target_fp32):
    out, summary = distilled
    table = pq.read_table(out)
    assert table.num_rows == summary["samples"] == len(GOOD)
    width = 5 * target_fp32.hidden_size
    assert table.schema.equals(distill_schema(width), check_metadata=False)
    assert table.schema.field("hidden").type == pa.list_(pa.list_(pa.float16(), width))
    meta = read_dataset_metadata(out)
    assert meta.target_id == target_fp32.target_id and meta.weights_hash == target_fp32.weights_hash
    assert meta.target_layer_ids == (1, 8, 14, 20, 27) and meta.hidden_size == 576
    assert meta.chat_template_hash == target_fp32.chat_template_hash() and meta.generation["max_new_tokens"] == 16
    assert sorted(p.name for p in out.glob("*.parquet")) == [f"part-{i:05d}.parquet" for i in range(4)]
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["samples"] == len(GOOD) and manifest["tokens"] == sum(table.column("num_tokens").to_pylist())
    assert manifest["raw_feature_bytes_per_token"] == width * 2
    assert 0 < manifest["bytes_per_token"] < width * 2  # zstd + byte-stream-split beat raw fp16
    assert manifest["config"]["max_new_tokens"] == 16 and manifest["source"]["hash"]
    for row in table.select(["input_ids", "loss_mask", "num_tokens"]).to_pylist():
        assert len(row["input_ids"]) == len(row["loss_mask"]) == row["num_tokens"]
        assert row["loss_mask"][-1] == 1 and row["loss_mask"][0] == 0  # prompt unscored, response scored


def test_loss_mask_covers_every_regenerated_turn(distilled, target_fp32):
    out, _ = distilled
    rows = read_rows(out)
    tok = target_fp32.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for rec in (GOOD[2], GOOD[7]):  # the two-turn conversations
        row = rows[sample_id(normalize_conversation(rec))]
        ids, mask = row["input_ids"], row["loss_mask"]
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        stops = [i for i in range(1, len(mask)) if mask[i - 1] and not mask[i]]  # one past each earlier span
        assert len(starts) == 2, "both regenerated assistant turns are scored"
        assert ids[stops[0] - 1] == end, "an earlier turn is scored up to and including its end-of-turn token"
        assert tok.decode(ids[:starts[0]]).endswith("<|im_start|>assistant\n")
        assert tok.decode(ids[:starts[1]]).endswith("<|im_start|>assistant\n")
        text = tok.decode(ids)
        second_user = [m["content"] for m in normalize_conversation(rec) if m["role"] == "user"][1]
        assert second_user in text and "old answer" not in text and "Joyful" not in text


def test_stored_hidden_states_equal_a_direct_forward(distilled, target_fp32):
    out, _ = distilled
    table = pq.read_table(out)
    layers = read_dataset_metadata(out).target_layer_ids
    for i in (0, table.num_rows - 1):
        ids = torch.tensor([table.column("input_ids")[i].as_py()])
        with torch.no_grad():
            hs = target_fp32.model(input_ids=ids, output_hidden_states=True).hidden_states
        direct = torch.cat([hs[l + 1][0] for l in layers], dim=-1)  # (T, n_taps*D): outputs of layers l
        stored = torch.from_numpy(hidden_arrays(table.slice(i, 1))[0].copy()).float()
        torch.testing.assert_close(stored, direct.half().float(), rtol=4e-3, atol=2e-2)


def test_corpus_command_indexes_every_regenerated_answer(distilled, target_fp32, tmp_path, capsys):
    """`dflash corpus`: one segment per scored span (its 3 lead tokens first), the target's
    identity recorded, the answers' own n-grams known; an existing file is not replaced."""
    from safetensors import safe_open

    from dflash.corpus import CorpusIndex
    from jobs.cli import main

    out, _ = distilled
    path = tmp_path / "corpus.safetensors"
    assert main(["corpus", "--data", str(out), "--out", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = pq.read_table(out, columns=["input_ids", "loss_mask"]).to_pylist()
    spans = [(i, j) for r in rows for i, j in _scored_spans(r["loss_mask"])]
    assert summary["segments"] == len(spans) and summary["tokens"] == sum(j - i + 3 for i, j in spans)
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata()["target_id"] == target_fp32.target_id
        assert f.metadata()["weights_hash"] == target_fp32.weights_hash
    index = CorpusIndex.load(path, target_fp32.vocab_size)
    for r in rows:
        ids, (i, j) = r["input_ids"], _scored_spans(r["loss_mask"])[0]
        assert index.next_token(ids[i - 3: i + 1]) is not None  # every answer 4-gram is in the table
    assert main(["corpus", "--data", str(out), "--out", str(path)]) == 2
    assert "exists" in capsys.readouterr().err

    # --base grows a corpus file: its answers first, then the data's
    grown = tmp_path / "grown.safetensors"
    assert main(["corpus", "--data", str(out), "--out", str(grown), "--base", str(path)]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["segments"] == 2 * summary["segments"] and both["tokens"] == 2 * summary["tokens"]
    assert CorpusIndex.load(grown, target_fp32.vocab_size).segments()[:summary["segments"]] == index.segments()
    # ... only a base of the same target and recipe, and a refused run writes nothing
    other = tmp_path / "other.safetensors"
    index.save(other, {"weights_hash": target_fp32.weights_hash, "generation": "{}"})
    for base, why in ((other, "one recipe"), (tmp_path / "missing.safetensors", "not found")):
        assert main(["corpus", "--data", str(out), "--out", str(tmp_path / "x.safetensors"), "--base", str(base)]) == 2
        assert why in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()


def _scored_spans(mask: list[int]) -> list[tuple[int, int]]:
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    return [(i, next((j for j in range(i, len(mask)) if not mask[j]), len(mask))) for i in starts]


def test_rejects_go_to_a_file_with_reasons(distilled):
    out, summary = distilled
    rejects = [json.loads(l) for l in (out / REJECTS_NAME).read_text().splitlines()]
    expected = sorted(reason for _, reason in BAD)
    assert sorted(r["reason"] for r in rejects) == expected
    assert summary["rejects"] == {k: expected.count(k) for k in set(expected)}
    assert all(r["sample_id"] and r["detail"] for r in rejects if r["reason"] != DUPLICATE)


def test_rerun_of_a_complete_run_computes_nothing(distilled):
    out, summary = distilled
    again = run_distill(DistillConfig(**(summary["config"] | {"target_layer_ids": None})))
    assert again["run"]["shards_computed"] == 0 and again["samples"] == summary["samples"]
    with pytest.raises(DistillConfigError, match="other settings"):
        run_distill(DistillConfig(**(summary["config"] | {"target_layer_ids": None, "max_new_tokens": 8})))


def test_a_larger_limit_grows_the_dataset_in_place(source, tmp_path, ray_session):
    first = run_distill(make_cfg(source, tmp_path / "g", limit=3, max_turns=1, max_new_tokens=4))
    assert first["samples"] == 3 and first["run"]["shards_computed"] == 2  # shards of 2 and 1
    before = (tmp_path / "g" / "part-00000.parquet").stat().st_mtime_ns
    grown = run_distill(make_cfg(source, tmp_path / "g", limit=6, max_turns=1, max_new_tokens=4))
    # shard 0 kept; the short shard 1 and the new shard 2 computed
    assert grown["samples"] == 6 and grown["run"]["shards_computed"] == 2 and grown["run"]["shards_skipped"] == 1
    assert (tmp_path / "g" / "part-00000.parquet").stat().st_mtime_ns == before
    assert pq.read_table(tmp_path / "g").num_rows == 6
    with pytest.raises(DistillConfigError, match="beyond this limit"):
        run_distill(make_cfg(source, tmp_path / "g", limit=2, max_turns=1, max_new_tokens=4))
    assert pq.read_table(tmp_path / "g").num_rows == 6


@pytest.mark.slow
def test_sampling_is_seeded_and_tokens_only_mode(source, tmp_path, ray_session):
    runs = [run_distill(make_cfg(source, tmp_path / f"s{k}", temperature=0.9, top_p=0.95, seed=7, limit=2,
                                 max_turns=1, features="none")) for k in range(2)]
    a, b = read_rows(tmp_path / "s0"), read_rows(tmp_path / "s1")
    assert a == b and len(a) == 2
    assert "hidden" not in pq.read_schema(tmp_path / "s0" / "part-00000.parquet").names
    assert runs[0]["raw_feature_bytes_per_token"] == 0


# --- crashes: nothing lost, nothing twice -------------------------------------------------------

def wait_for_shards(out: Path, n: int, timeout: float = 180) -> None:
    t0 = time.time()
    while len(list(out.glob("part-*.parquet"))) < n:
        if time.time() - t0 > timeout:
            raise TimeoutError(f"no {n} shard(s) in {out} after {timeout} s")
        time.sleep(0.05)


def start_driver(cfg: DistillConfig, address: str, log: Path) -> subprocess.Popen:
    """`run_distill` in its own driver process, attached to an existing Ray cluster."""
    code = ("import json, sys, torch; torch.set_num_threads(1);"
            "from pipelines.distill import DistillConfig, run_distill;"
            "run_distill(DistillConfig(**json.loads(sys.argv[1])))")
    args = json.dumps(cfg.as_dict() | {"ray_address": address, "target_layer_ids": None})
    return subprocess.Popen([sys.executable, "-c", code, args], cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=os.environ | {"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_actor_killed_mid_run(distilled, source, tmp_path, ray_session):
    import ray._private.state as state

    reference = read_rows(distilled[0])
    out = tmp_path / "out"
    killed = []

    def kill_one_actor():
        wait_for_shards(out, 1)
        for info in state.actors().values():
            if "MapWorker" in info["ActorClassName"] and info["State"] == "ALIVE" and info["Pid"]:
                os.kill(info["Pid"], signal.SIGKILL)
                killed.append(info["Pid"])
                return

    killer = threading.Thread(target=kill_one_actor, daemon=True)
    killer.start()
    first = run_distill(make_cfg(source, out))  # Ray Data restarts the actor and retries its shard
    killer.join()
    assert killed, "no Ray Data actor was found to kill"
    assert first["run"]["shards_computed"] == 4
    assert_exactly_once(out, reference)
    assert run_distill(make_cfg(source, out))["run"]["shards_computed"] == 0
    assert_exactly_once(out, reference)


@pytest.mark.slow
def test_driver_killed_mid_run(distilled, source, tmp_path, ray_session):
    reference = read_rows(distilled[0])
    out = tmp_path / "out"
    cfg = make_cfg(source, out)
    proc = start_driver(cfg, ray_session.get_runtime_context().gcs_address, tmp_path / "driver.log")
    try:
        wait_for_shards(out, 1)
    finally:
        proc.kill()
        proc.wait()
    done_before = len(list(out.glob("part-*.parquet")))
    assert 1 <= done_before < 4, (tmp_path / "driver.log").read_text()[-2000:]
    again = run_distill(cfg)
    assert again["run"]["shards_computed"] == 4 - done_before
    assert_exactly_once(out, reference)


@pytest.mark.slow
def test_node_removed_mid_run_then_rerun(distilled, source, tmp_path):
    """Two-node cluster, one actor per node; the worker node dies after the first shard; the
    driver is stopped if it is still waiting, and a rerun on the surviving node finishes."""
    import ray
    from ray.cluster_utils import Cluster

    reference = read_rows(distilled[0])
    ray.shutdown()  # the shared session; conftest's start_local_ray() restarts it for later tests
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": int(3e8), "temp_dir": RAY_TMP})
    try:
        worker = cluster.add_node(num_cpus=1, object_store_memory=int(3e8))
        cluster.wait_for_nodes()
        out = tmp_path / "out"
        proc = start_driver(make_cfg(source, out, num_actors=2), cluster.address, tmp_path / "driver.log")
        try:
            wait_for_shards(out, 1)
            cluster.remove_node(worker, allow_graceful=False)
            try:  # Ray Data may finish on the surviving node, or (seen here) wait for the lost actor's
                proc.wait(timeout=8)  # capacity to come back, which a cluster autoscaler would provide
            except subprocess.TimeoutExpired:
                pass
        finally:
            proc.kill()
            proc.wait()
        ray.init(address=cluster.address)
        again = run_distill(make_cfg(source, out, num_actors=1))
        assert again["shards"] == 4
        assert_exactly_once(out, reference)
    finally:
        ray.shutdown()
        cluster.shutdown()


# --- without Ray: plan here, generate elsewhere (jobs/distill_local.py) -------------------------

def test_local_run_of_a_plan_writes_the_shards_ray_writes(distilled, source, tmp_path):
    """plan -> run (no Ray, as on a lent GPU box) -> copy -> dflash distill finalises: the same
    rows and features as the Ray Data job, and nothing recomputed."""
    import gzip
    import shutil

    from jobs.distill_local import parse_shard_range, run_plan, write_plan

    ray_out, ray_summary = distilled
    cfg = make_cfg(source, tmp_path / "data")
    plan = write_plan(cfg, tmp_path / "plan.json.gz")
    assert plan["shards"] == ray_summary["shards"] and (tmp_path / "data" / "_run.json").exists()
    assert plan["fingerprint"] == ray_summary["fingerprint"]  # where it runs is not part of the content

    none = run_plan(tmp_path / "plan.json.gz", tmp_path / "gen", device="cpu", seconds=0, threads=1)
    assert none["shards_done"] == 0 and not list((tmp_path / "gen").glob("*.parquet"))  # out of time: no shard
    # a range of the plan (as on a second machine): shards 1.. only, then shard 0
    rest = run_plan(tmp_path / "plan.json.gz", tmp_path / "gen", device="cpu", seconds=float("inf"), threads=1,
                    shards=(1, None))
    assert rest["shards_done"] == plan["shards"] - 1 and rest["limit"] == ray_summary["samples"]
    assert not (tmp_path / "gen" / "part-00000.parquet").exists()
    first = run_plan(tmp_path / "plan.json.gz", tmp_path / "gen", device="cpu", seconds=float("inf"), threads=1,
                     shards=parse_shard_range("0"))
    assert first["shards_done"] == 1 and (tmp_path / "gen" / "part-00000.parquet").exists()
    assert len(list((tmp_path / "gen").glob("part-*.parquet"))) == plan["shards"]
    with pytest.raises(ValueError, match="not a range"):
        run_plan(tmp_path / "plan.json.gz", tmp_path / "gen", device="cpu", seconds=1, threads=1,
                 shards=(plan["shards"], None))
    for f in (tmp_path / "gen").glob("part-*.parquet"):
        shutil.copy(f, tmp_path / "data")
    summary = run_distill(cfg)  # todo is empty: no Ray pool starts
    assert summary["run"]["shards_computed"] == 0 and summary["samples"] == ray_summary["samples"]
    assert_exactly_once(tmp_path / "data", read_rows(ray_out))
    mine, theirs = pq.read_table(tmp_path / "data"), pq.read_table(ray_out)
    assert mine.schema.metadata == theirs.schema.metadata
    by_id = {r: i for i, r in enumerate(theirs.column("sample_id").to_pylist())}
    for i, sid in enumerate(mine.column("sample_id").to_pylist()):
        assert mine.column("hidden")[i].as_py() == theirs.column("hidden")[by_id[sid]].as_py()

    with gzip.open(tmp_path / "bad.json.gz", "wt") as f:
        json.dump({"format": 99}, f)
    with pytest.raises(ValueError, match="plan format 99"):
        run_plan(tmp_path / "bad.json.gz", tmp_path / "gen2", device="cpu", seconds=1, threads=1)


# --- partly broken sources and refused runs (issue 29): no Ray needed -------------------------------

def _tokenizer():
    from dflash.target import inspect_target

    return inspect_target("default").tokenizer


def test_a_broken_json_array_element_is_rejected_alone(tmp_path):
    """One broken element mid-way costs exactly that element (a reject naming its index),
    never the records after it; a last element cut off by the end of the file is one reject."""
    parts = [json.dumps(r) for r in GOOD]
    parts.insert(3, '{"messages": [{"role": "user", "content": "broken" oops}]}')
    path = tmp_path / "src.json"
    path.write_text("[\n" + ",\n".join(parts) + ",\n" + json.dumps(GOOD[1])[:-5])  # ... and a cut-off tail
    plan = plan_samples(make_cfg(path, tmp_path / "out"), _tokenizer())
    distinct = {sample_id(normalize_conversation(r)) for r in GOOD}
    assert {s["sample_id"] for s in plan.samples} == distinct and len(plan.samples) == len(GOOD)
    malformed = [r for r in plan.rejects if r["reason"] == MALFORMED]
    assert len(malformed) == 2 and "src.json[3]" in malformed[0]["detail"], plan.rejects
    assert "truncated" in malformed[1]["detail"] and f"src.json[{len(GOOD) + 1}]" in malformed[1]["detail"]
    # a malformed record has no knowable split: the train split's rejects list it too
    train = plan_samples(make_cfg(path, tmp_path / "out", split="train"), _tokenizer())
    assert sum(r["reason"] == MALFORMED for r in train.rejects) == 2


def test_invalid_utf8_is_a_reject_in_jsonl_and_refuses_a_json_file_before_any_write(tmp_path):
    from pipelines.distill import prepare_run

    lines = [json.dumps(r).encode() for r in GOOD[:4]]
    lines.insert(2, b'{"prompt": "caf\xe9 au lait"}')  # latin-1, not UTF-8
    jsonl = tmp_path / "src.jsonl"
    jsonl.write_bytes(b"\n".join(lines) + b"\n")
    plan = plan_samples(make_cfg(jsonl, tmp_path / "o1"), _tokenizer())
    assert len(plan.samples) == 4 and [r["detail"] for r in plan.rejects] == [f"{jsonl}:3: invalid UTF-8 at byte 15 "
                                                                               "of the line"]
    bad = tmp_path / "src.json"
    bad.write_bytes(b"[" + b", ".join(lines) + b"]")
    out = tmp_path / "o2"
    with pytest.raises(DistillConfigError, match=r"src.json: invalid UTF-8 at byte \d+"):
        prepare_run(make_cfg(bad, out))
    assert sorted(p.name for p in out.iterdir()) == []  # no run record, no rejects: nothing to refuse later
    bad.write_bytes(b"[" + b", ".join(lines[:2] + lines[3:]) + b"]")  # the corrected source is welcome
    run = prepare_run(make_cfg(bad, out))
    assert len(run.plan.samples) == 4 and (out / "_run.json").exists()


def test_a_refused_rerun_changes_no_file(tmp_path, source):
    """A lowered limit (or other settings) is refused before _rejects.jsonl or _run.json is touched."""
    from dflash.data import shard_name
    from pipelines.distill import prepare_run

    out = tmp_path / "out"
    run = prepare_run(make_cfg(source, out, limit=6))
    for i in range(len(run.shards)):  # stand-ins for the shards a finished run leaves
        (out / shard_name(i)).write_bytes(b"")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before[REJECTS_NAME].splitlines()) == len(run.plan.rejects) > 0
    with pytest.raises(DistillConfigError, match="beyond this limit"):
        prepare_run(make_cfg(source, out, limit=2))
    with pytest.raises(DistillConfigError, match="other settings"):
        prepare_run(make_cfg(source, out, limit=6, seed=1))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
