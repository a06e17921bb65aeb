"""Drafter directories for each serving engine: `dflash export --format vllm|sglang|full`.

    vllm    the layout dflash.checkpoint writes: a reduced draft vocabulary as vLLM stores
            it (top-level draft_vocab_size, d2t, lm_head.weight = the target head's rows),
            or the full vocabulary with no lm_head. vLLM 0.32 loads it with method "dflash".
    sglang  no draft vocabulary: the drafter scores the target's whole vocabulary through the
    full    target's own head (no lm_head, no d2t). SGLang (>= 0.5.11) has no draft
            vocabulary and ignores tensors it does not know; "full" is the same directory
            under the engine-neutral name. Still lossless; drafts may now pick tokens the
            reduced vocabulary left out, so acceptance can differ slightly.

Every format keeps the same drafter weights, our private config section (decode block
size), a mask_embedding.pt and the other files of the source directory (training record,
corpus/). The source may be any layout dflash.checkpoint reads, including the older
`draft_vocab` one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash.checkpoint import (CONFIG_NAME, D2T, HEAD, MASK_EMBEDDING_NAME, OLD_VOCAB, WEIGHTS_NAME,
                               load_drafter, save_drafter)
from dflash.drafter import DFlashDrafter
from dflash.target import parse_dtype

FORMATS = ("vllm", "sglang", "full")
# source files the conversion rewrites; every other file or folder is copied as it is
_REWRITTEN = (CONFIG_NAME, WEIGHTS_NAME, MASK_EMBEDDING_NAME)


def drafter_layout(path: str | Path) -> str:
    """Which layout a drafter directory is in: "vllm" (reduced vocabulary via d2t),
    "full" (no reduced vocabulary) or "legacy" (the older `draft_vocab` tensor, which vLLM
    refuses)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / WEIGHTS_NAME), "pt") as f:
        names = set(f.keys())
    return "legacy" if OLD_VOCAB in names else "vllm" if D2T in names else "full"


def convert_drafter(src_dir: str | Path, out_dir: str | Path, format: str = "vllm",
                    lm_head_weight: torch.Tensor | None = None, dtype: str | torch.dtype | None = None,
                    overwrite: bool = False) -> Path:
    """Write the drafter in `src_dir` to `out_dir` in `format` (see the module docstring).

    lm_head_weight: the target's LM head (V, D), needed only to write a reduced vocabulary
    from a source that does not store its rows (the legacy layout) for a target other than
    the default. dtype: of the written weights; None keeps the source's. out_dir may be
    src_dir (converted in place); otherwise it must not exist or be empty, unless overwrite."""
    if format not in FORMATS:
        raise ValueError(f"unknown drafter format {format!r}; use one of {', '.join(FORMATS)}")
    src, out = Path(src_dir), Path(out_dir)
    in_place = out.resolve() == src.resolve()
    if not in_place and out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    raw = json.loads((src / CONFIG_NAME).read_text()) if (src / CONFIG_NAME).is_file() else {}
    dtype = parse_dtype(dtype or raw.get("dtype") or raw.get("torch_dtype") or "fp32")
    drafter = load_drafter(src, dtype="fp32")  # fp32 holds bf16 and fp16 values exactly
    head = lm_head_weight
    if format == "vllm":
        head = head if head is not None else stored_head_rows(src)
    elif drafter.draft_vocab is not None:
        drafter = without_draft_vocab(drafter)
    if not in_place:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for item in src.iterdir():
            if item.name not in _REWRITTEN:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    return save_drafter(drafter, out, dtype=dtype, lm_head_weight=head)


def stored_head_rows(src_dir: str | Path) -> torch.Tensor | None:
    """The (K, D) lm_head.weight a vLLM-layout directory stores, in ascending target-id order
    (the order of DFlashDrafter.draft_vocab); None when it stores none."""
    state = load_file(str(Path(src_dir) / WEIGHTS_NAME))
    if D2T not in state or HEAD not in state:
        return None
    ids = torch.arange(state[D2T].numel()) + state[D2T].long()
    return state[HEAD].index_select(0, ids.argsort())


def without_draft_vocab(drafter: DFlashDrafter) -> DFlashDrafter:
    """The same drafter scoring the whole target vocabulary."""
    if drafter.draft_vocab is None:
        return drafter
    full = DFlashDrafter(drafter.config.replace(draft_vocab_size=0))
    state = {k: v for k, v in drafter.state_dict().items() if k != OLD_VOCAB}
    full.load_state_dict(state, strict=True)
    full.set_mask_embedding(drafter.mask_embedding)
    return full.to(drafter.fc.weight.dtype).eval()

