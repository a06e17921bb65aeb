"""jobs/: config parsing, the `dflash` command line's answers to bad input, `dflash bench`
on two prompts, a real `ray job submit` of a small distill against a real head started with
`ray start --head`, and the end-to-end demo at a reduced size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dflash.config_file import ConfigError, build_config, load_config, parse_override
from jobs.cli import main
from jobs.demo import DemoConfig, free_port, run_demo
from pipelines.distill import DistillConfig
from pipelines.train import TrainConfig

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"




def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(err: str, command: str) -> str:
    """The last stderr line is the error; no traceback anywhere."""
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"dflash {command}: error: "), err
    return line


# --- config parsing and validation ---------------------------------------------------------

def test_overrides_parse_as_yaml_values():
    assert parse_override("lr=0.001") == ("lr", 0.001)
    assert parse_override("target_layer_ids=[1, 14, 27]") == ("target_layer_ids", [1, 14, 27])
    assert parse_override("ray_address=null") == ("ray_address", None)
    assert parse_override("question=a=b") == ("question", "a=b")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("lr")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("=3")


def test_values_are_checked_against_the_dataclass_and_errors_name_the_key():
    cfg = build_config(TrainConfig, {"lr": 1, "target_layer_ids": [1, 2], "precision": "bf16"})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.target_layer_ids == (1, 2)
    assert load_config(TrainConfig, None, ["lr=3e-4"]).lr == 3e-4  # YAML 1.1 reads 3e-4 as a string
    cases = [({"max_steps": "ten"}, "max_steps: expected an integer"),
             ({"max_steps": True}, "max_steps: expected an integer"),
             ({"lr": "fast"}, "lr: expected a number"),
             ({"precision": "fp8"}, r"precision: 'fp8' is not one of \['fp32', 'bf16'\]"),
             ({"target_layer_ids": [1, "x"]}, r"target_layer_ids\[1\]: expected an integer"),
             ({"eval_at_end": "yes"}, "eval_at_end: expected true/false"),
             ({"bogus": 1, "lr_typo": 2}, r"unknown key\(s\) \['bogus', 'lr_typo'\]"),
             ({"block_size": 1}, "block_size must be >= 2"),
             ({"block_size": 8, "decode_block_size": 9}, r"decode_block_size must be 0 \(= block_size\) or in 2..8")]
    for values, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_config(TrainConfig, values, "test")


def test_every_shipped_config_loads_and_opens_with_its_command():
    from serve.config import load_serve_config

    import yaml

    stages = {"distill": DistillConfig, "train": TrainConfig, "demo": DemoConfig}
    paths = sorted((REPO / "jobs/configs").rglob("*.yaml"))
    assert len(paths) >= 7
    for path in paths:
        stage = yaml.safe_load(path.read_text())["stage"]
        cfg = load_config(stages[stage], path)
        assert type(cfg) is stages[stage]
        assert f"dflash {stage} --config {path.relative_to(REPO)}" in path.read_text(), path
    assert load_serve_config(REPO / "serve/config.yaml").target == "default"
    demo = load_config(DemoConfig, REPO / "jobs/configs/demo.yaml")
    assert demo == DemoConfig(), "demo.yaml and DemoConfig's defaults tell the same story"


def test_a_config_for_another_stage_and_a_missing_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="config for stage 'distill', not 'train'"):
        load_config(TrainConfig, REPO / "jobs/configs/distill.yaml")
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(TrainConfig, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(TrainConfig, tmp_path / "list.yaml")


# --- the command line's answers to bad input -----------------------------------------------

def test_cli_bad_input_is_one_line_nonzero_and_overwrites_nothing(capsys, tmp_path, target_fp32):
    other_target = str(target_fp32.model.name_or_path)  # the converted default as a plain HF dir: another id
    cases = [
        (["train", "--config", str(tmp_path / "missing.yaml")], "train", "config file not found"),
        (["train", "--config", "jobs/configs/distill.yaml"], "train", "config for stage 'distill', not 'train'"),
        (["demo", "--config", "jobs/configs/train.yaml"], "demo", "config for stage 'train', not 'demo'"),
        (["distill", "--config", "jobs/configs/distill.yaml", "limti=3"], "distill", "unknown key"),
        (["train", "max_steps=many"], "train", "max_steps: expected an integer"),
        (["bench", "--prompts", str(tmp_path / "none.jsonl")], "bench", "prompts file not found"),
        (["bench", "--dataset", "no-such-set"], "bench", "unknown dataset 'no-such-set'"),
        (["generate", "--prompt", "hi", "--drafter", str(tmp_path / "nodrafter")], "generate",
         "drafter directory not found"),
        (["generate", "--prompt", "hi", "--target", other_target, "--drafter", "default"], "generate",
         "no reference drafter ships for target hf:"),
        (["serve", f"drafter={tmp_path / 'nodrafter'}"], "serve", "drafter directory not found"),
        (["generate", "--prompt", "hi", "--tree-nodes", "1"], "generate", "tree_nodes must be 0 (off) or >= 2"),
        (["generate", "--prompt", "hi", "--block-size", "9"], "generate", "decode_block_size must be 0"),
        (["serve", "block_size=9"], "serve", "decode_block_size must be 0"),
        (["serve", "tree_nodes=-3"], "serve", "tree_nodes must be 0 (off) or >= 2"),
        (["generate", "--prompt", "hi", "--speculation-margin", "-1"], "generate", "speculation_margin must be in"),
        (["export", str(tmp_path / "norun"), str(tmp_path / "x")], "export", "no training checkpoint"),
        (["train", f"data={tmp_path / 'nodata'}", f"output_dir={tmp_path / 'o'}"], "train", "data directory not found"),
    ]
    for argv, command, message in cases:
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert message in one_line_error(err, command), (argv, err)

    # output directories that hold something else: refused, and the files are untouched
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious.txt").write_text("mine")
    (keep / "part-00000.parquet").write_text("someone else's shard")
    (tmp_path / "bench.json").write_text("{}")
    for argv, command, message in [
        (["bench", "--prompts", "x.jsonl", "--out", str(keep)], "bench", "exists and is not empty"),
        (["bench", "--prompts", "x.jsonl", "--json", str(tmp_path / "bench.json")], "bench", "exists and is not empty"),
        (["demo", f"output_dir={keep}"], "demo", "holds something other than a demo run"),
        (["distill", f"output_dir={keep}", "limit=1"], "distill", "already holds .parquet files not written by this run"),
    ]:
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2, (argv, err)
        assert message in one_line_error(err, command), (argv, err)
    assert sorted(p.name for p in keep.iterdir()) == ["part-00000.parquet", "precious.txt"]
    assert (keep / "precious.txt").read_text() == "mine" and (tmp_path / "bench.json").read_text() == "{}"


def test_generate_decodes_with_the_shipped_drafter_by_default(capsys, target_fp32):
    """No --drafter: the reference drafter of the default target (at its decode block of 4,
    with context lookup), plain AR with 'none' or on a target with no shipped drafter; the
    same tokens every way (fp32)."""
    from dflash.checkpoint import reference_drafter_dir

    args = ["generate", "--chat", "--prompt", "Name three colors.", "--dtype", "fp32", "--max-new-tokens", "16",
            "--json", "--threads", "1"]
    runs = {}
    for name, extra in [("auto", []), ("no-lookup", ["--no-lookup", "--corpus", "none", "--block-size", "4"]),
                        ("none", ["--drafter", "none"]),
                        ("other", ["--target", str(target_fp32.model.name_or_path)]), ("tree", ["--tree-nodes", "24"])]:
        rc, out, err = run_cli(capsys, *args, *extra)
        assert rc == 0, err
        runs[name] = (json.loads(out), err)
    auto, plain, none, other = (runs[k][0] for k in ("auto", "no-lookup", "none", "other"))
    assert auto["drafter"] == plain["drafter"] == str(reference_drafter_dir(target_fp32.target_id))
    assert len(auto["stats"]["acceptance_histogram"]) == 8  # copied drafts of 7: emit 1..8 per cycle
    assert len(plain["stats"]["acceptance_histogram"]) == 4  # blocks of 4: emit 1..4 per cycle
    assert plain["stats"]["lookup_cycles"] == plain["stats"]["corpus_cycles"] == 0
    assert max(plain["stats"]["acceptance_lengths"]) > 1  # some drafts were accepted
    assert none["drafter"] is None and other["drafter"] is None
    assert set(none["stats"]["acceptance_lengths"]) == {1}
    assert "no reference drafter ships for hf:" in runs["other"][1]
    tree = runs["tree"][0]
    assert auto["token_ids"] == plain["token_ids"] == none["token_ids"] == other["token_ids"] == tree["token_ids"]
    assert max(tree["stats"]["acceptance_lengths"]) > 1


def test_generate_with_a_corpus_file_drafts_from_it(capsys, tmp_path, target_fp32):
    """--corpus FILE with no drafter: corpus cycles only, the same tokens as plain AR (fp32);
    a corpus for another vocabulary or a missing file is one line of error."""
    from dflash.corpus import CorpusIndex

    args = ["generate", "--chat", "--prompt", "Name three colors.", "--dtype", "fp32", "--max-new-tokens", "24",
            "--json", "--threads", "1", "--drafter", "none"]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    plain = json.loads(out)
    answer = plain["prompt_token_ids"][-3:] + plain["token_ids"]
    path = CorpusIndex.from_segments([answer[:14]], target_fp32.vocab_size).save(tmp_path / "c.safetensors")
    rc, out, err = run_cli(capsys, *args, "--corpus", str(path))
    assert rc == 0, err
    drafted = json.loads(out)
    assert drafted["token_ids"] == plain["token_ids"] and drafted["stats"]["corpus_cycles"] > 0
    # pinned width (any --block-size): every cycle verifies the whole corpus chain, so the
    # answer the corpus holds comes several tokens a cycle (adaptive width may verify less)
    rc, out, err = run_cli(capsys, *args, "--corpus", str(path), "--block-size", "2")
    assert rc == 0, err
    pinned = json.loads(out)
    assert pinned["token_ids"] == plain["token_ids"]
    assert pinned["stats"]["corpus_cycles"] > 0 and max(pinned["stats"]["acceptance_lengths"]) > 3
    other = CorpusIndex.from_segments([[1, 2, 3, 4, 5]], 100).save(tmp_path / "other.safetensors")
    for bad, msg in [(other, "vocabulary of 100"), (tmp_path / "missing.safetensors", "corpus file not found")]:
        rc, _, err = run_cli(capsys, *args, "--corpus", str(bad))
        assert rc == 2 and msg in one_line_error(err, "generate")


def test_bench_on_two_prompts_writes_every_field_and_plot(capsys, tmp_path):
    prompts = tmp_path / "two.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n"
                       + json.dumps({"messages": [{"role": "user", "content": "Name a color."}]}) + "\n")
    out = tmp_path / "bench"
    rc, stdout, err = run_cli(capsys, "bench", "--prompts", str(prompts), "--drafter", "random", "--dtype", "fp32",
                              "--block-size", "4", "--max-new-tokens", "8", "--out", str(out), "--threads", "1",
                              "--drafter-only")
    assert rc == 0, err
    doc = json.loads((out / "bench.json").read_text())
    runs = doc["runs"]
    assert [r["temperature"] for r in runs] == [0.0, 1.0]  # both by default
    fields = ("num_prompts", "tau", "acceptance_histogram", "ar_tokens_per_s", "dflash_tokens_per_s", "speedup",
              "exact_match_rate", "lossless", "prompt_lookup_tokens_per_s", "prompt_lookup_speedup",
              "draft_time_per_cycle_ms", "verify_time_per_cycle_ms", "per_prompt", "lookup", "lookup_cycle_fraction",
              "drafter_only_tau", "drafter_only_speedup", "acceptance_by_position", "cycle_cost_ar_steps")
    for r in runs:
        missing = [f for f in fields if f not in r]
        assert not missing, missing
        assert r["num_prompts"] == 2 and len(r["per_prompt"]) == 2 and r["dataset"] == "two.jsonl"
        assert 1.0 <= r["tau"] <= 8 and len(r["acceptance_histogram"]) == 8 and sum(r["acceptance_histogram"]) > 0
        assert r["lookup"]["num_tokens"] == 7 and 0 <= r["lookup_cycle_fraction"] <= 1
        assert 1.0 <= r["drafter_only_tau"] <= 4 and r["drafter_only_speedup"] > 0
        assert r["ar_tokens_per_s"] > 0 and r["dflash_tokens_per_s"] > 0 and r["prompt_lookup_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["dflash_tokens_per_s"] / r["ar_tokens_per_s"], rel=1e-3)
        assert r["cycle_cost_ar_steps"] == pytest.approx(r["tau"] / r["speedup"], rel=1e-3)
        # tau = 1 + p1 + p1 p2 + ...: the rates by position account for every accepted token
        reach, implied = 1.0, 1.0
        for p in r["acceptance_by_position"]:
            reach *= p or 0.0
            implied += reach
        assert len(r["acceptance_by_position"]) == 7 and implied == pytest.approx(r["tau"], rel=1e-3)
    greedy, sampled = runs
    assert greedy["lossless"] is True and greedy["exact_match_rate"] == 1.0 and greedy["lossless_rule"] == "exact"
    assert greedy["prompt_lookup_exact_match_rate"] == 1.0  # prompt lookup is lossless too
    assert sampled["lossless"] is None  # checked in distribution by tests/test_sampling.py
    table = (out / "bench.md").read_text().splitlines()
    assert table[0].startswith("| dataset | T |") and len(table) == 4
    assert table[2].startswith("| two.jsonl | 0 | 2 |") and "| yes |" in table[2]
    for png in ("acceptance_histogram.png", "speedup.png"):
        data = (out / png).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, png
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert [s["temperature"] for s in summary] == [0.0, 1.0] and "prompt_lookup_speedup" in summary[0]


# --- a real cluster job: `ray start --head` + `ray job submit` -------------------------------

@pytest.mark.slow
def test_ray_job_submit_distill_against_a_local_head(tmp_path):
    """The documented recipe, run as written: a head on 127.0.0.1, the repository as the
    job's working dir, `dflash distill` as the entrypoint, output on an absolute path."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    dash, gcs = free_port(), free_port()
    temp = Path("/tmp") / f"dflash-head-{os.getpid()}"  # short: Ray's socket paths have a length limit
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
         "--num-cpus=2", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)
    out = tmp_path / "distill"
    try:
        address = f"http://127.0.0.1:{dash}"
        deadline = time.time() + 120
        while True:  # the job server answers once the dashboard is up
            probe = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env,
                                   capture_output=True, text=True)
            if probe.returncode == 0:
                break
            assert head.poll() is None, head.stdout.read()
            assert time.time() < deadline, probe.stderr
            time.sleep(2)
        job = subprocess.run(
            [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--",
             "dflash", "distill", "--config", "jobs/configs/distill.yaml", "limit=3", "max_new_tokens=8",
             "num_taps=2", "shard_size=2", "batch_size=2", f"output_dir={out}", "progress=false"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout.lower(), job.stdout[-2000:]
    finally:
        os.killpg(head.pid, 15)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["samples"] == 3 and manifest["shards"] == 2
    table = pq.read_table(out)  # plain pyarrow reads the job's output directory
    assert table.num_rows == 3 and set(table.column_names) >= {"sample_id", "input_ids", "loss_mask", "hidden"}


# --- the end-to-end demo, reduced -------------------------------------------------------------

@pytest.mark.slow
def test_demo_pipeline_at_reduced_size(ray_session, tmp_path, capsys):
    cfg = DemoConfig(output_dir=str(tmp_path / "demo"), samples=4, max_new_tokens=16, num_taps=2, distill_actors=1,
                     train_steps=3,
                     train_block_size=4, num_anchors=4, bench_prompts=2, bench_max_new_tokens=8, fp32_check_prompts=1,
                     serve_max_tokens=6)
    summary = run_demo(cfg)
    out = Path(cfg.output_dir)
    assert summary["distill"]["samples"] == 4 and summary["train"]["steps"] == 3
    assert [r["temperature"] for r in summary["bench"]] == [0.0, 1.0]
    assert summary["bench"][0]["lossless"] is True and summary["fp32_exact"] is True and summary["lossless"] is True
    assert all(r["prompt_lookup_speedup"] > 0 and 1.0 <= r["tau"] <= 8 for r in summary["bench"])  # copies: 8 wide
    serve = summary["serve"]
    assert serve["text"].strip() and serve["usage"]["completion_tokens"] <= 6 and serve["dflash"]["cycles"] >= 1
    assert summary["train"]["drafter_dir"] == str(out / "train" / "run" / "drafter")
    from dflash.checkpoint import reference_drafter_dir  # bench and serve ran the shipped drafter

    assert summary["drafter"] == str(reference_drafter_dir("default:SmolLM2-135M-Instruct"))
    bench_run = json.loads((out / "bench" / "bench.json").read_text())["runs"][0]
    assert bench_run["block_size"] == 4 and bench_run["corpus"]["tokens"] > 0  # the shipped corpus, found by auto
    assert (out / "train" / "run" / "drafter" / "model.safetensors").is_file()
    for png in (out / "training.png", out / "bench" / "acceptance_histogram.png", out / "bench" / "speedup.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC, png
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    err = capsys.readouterr().err
    for marker in ("[demo] 1/4 distill", "[demo] 2/4 train", "[demo] 3/4 bench", "[demo] 4/4 serve",
                   "dflash demo: summary", "tau"):
        assert marker in err, marker

    # the same directory with other settings is refused, and nothing in it changes
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="holds a demo run made with other settings"):
        run_demo(DemoConfig(**{**cfg.__dict__, "train_steps": 4}))
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before


def test_export_converts_a_drafter_directory_between_engine_formats(capsys, tmp_path, target_fp32):
    """`dflash export DRAFTER_DIR OUT --format sglang`: the shipped (vLLM-layout) drafter
    without its draft vocabulary; an existing OUT is refused unless --overwrite."""
    from dflash.checkpoint import load_drafter, reference_drafter_dir
    from dflash.export_formats import drafter_layout

    src = reference_drafter_dir(target_fp32.target_id)
    assert drafter_layout(src) == "vllm"
    rc, out, err = run_cli(capsys, "export", str(src), str(tmp_path / "sg"), "--format", "sglang")
    assert rc == 0, err
    assert json.loads(out) == {"exported": str(tmp_path / "sg"), "format": "sglang"}
    assert drafter_layout(tmp_path / "sg") == "full"
    assert load_drafter(tmp_path / "sg", target=target_fp32, dtype="fp32").draft_vocab is None
    rc, _, err = run_cli(capsys, "export", str(src), str(tmp_path / "sg"), "--format", "vllm")
    assert rc == 2 and "exists" in one_line_error(err, "export")
    rc, _, err = run_cli(capsys, "export", str(src), str(tmp_path / "sg"), "--format", "vllm", "--overwrite")
    assert rc == 0 and drafter_layout(tmp_path / "sg") == "vllm"
