"""engine: vllm for distillation (pipelines/vllm_generate.py): the real vLLM writes the
responses in the distillation actor, our pass taps the features. Against engine native on
the same prompts (fp32 greedy): the same tokens, loss masks and Parquet contract."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from conftest import start_local_ray

from dflash.data import hidden_arrays, read_dataset_metadata
from jobs.cli import main as dflash_main
from pipelines.distill import DistillConfig, run_distill

PROMPTS = [
    {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"prompt": "Write one sentence about cats."},
    {"conversations": [{"from": "human", "value": "Hi! Who are you?"}, {"from": "gpt", "value": "an old answer"},
                       {"from": "human", "value": "Tell me a fun fact."}]},
    {"prompt": "Count from one to five."},
]


def make_cfg(source, out, **kw) -> DistillConfig:
    base = dict(source=str(source), split="all", limit=0, max_new_tokens=20, max_turns=2, max_seq_len=512,
                shard_size=2, batch_size=2, num_actors=1, num_cpus_per_actor=1, dtype="fp32", output_dir=str(out),
                progress=False)
    return DistillConfig(**(base | kw))


def test_engine_vllm_without_vllm_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    rc = dflash_main(["distill", "--config", "jobs/configs/distill.yaml", "engine=vllm",
                      f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "vLLM" in err[0]
    assert not (tmp_path / "out").exists()  # nothing written


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match="unknown engine"):
        DistillConfig(engine="sglang")


@pytest.mark.slow
def test_engine_vllm_rows_equal_engine_native(tmp_path):
    start_local_ray()
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    native = run_distill(make_cfg(source, tmp_path / "native"))
    vllm = run_distill(make_cfg(source, tmp_path / "vllm", engine="vllm"))
    assert native["samples"] == vllm["samples"] == len(PROMPTS)
    rows = {}
    for name in ("native", "vllm"):
        table = pq.read_table(tmp_path / name)  # plain pyarrow over the directory
        rows[name] = {r["sample_id"]: r for r in table.select(["sample_id", "input_ids", "loss_mask"]).to_pylist()}
        assert len(hidden_arrays(table)) == table.num_rows  # features readable, one array per row
    assert rows["native"] == rows["vllm"]  # fp32 greedy: the same tokens and loss masks, multi-turn included
    assert any(sum(r["loss_mask"]) > 0 for r in rows["vllm"].values())
    assert read_dataset_metadata(tmp_path / "native") == read_dataset_metadata(tmp_path / "vllm")
