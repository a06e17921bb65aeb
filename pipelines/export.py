"""Export a training run's latest checkpoint as one drafter directory.

    dflash export RUN_DIR OUT_DIR

The checkpoint holds DeepSpeed ZeRO shards of DrafterObjective (parameters under
"drafter.", the tap_scale buffer) plus train_state.json (step, drafter config, train
config). Export gathers the shards into fp32 weights, folds tap_scale into fc (the public
layout reads raw taps) and writes the public DFlash layout with dflash.checkpoint.save_drafter,
plus training.json (step, checkpoint, train config). The shards are read with
weights-only loads (pipelines.safe_load): a crafted run directory cannot run code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflash.config import DrafterConfig
from dflash.drafter import DFlashDrafter
from dflash.training import fold_tap_scale
from pipelines.safe_load import weights_only_loads
from pipelines.train_config import DS_DIR, DS_TAG, STATE_NAME


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The run's checkpoint with the highest step (only complete ones: state + shards)."""
    found = []
    for d in Path(run_dir).glob("checkpoint_*"):
        state = d / STATE_NAME
        if state.is_file() and (d / DS_DIR).is_dir():
            found.append((json.loads(state.read_text())["step"], d))
    if not found:
        raise FileNotFoundError(f"no training checkpoint in {run_dir}")
    return max(found)[1]


def export_run(run_dir: str | Path, out_dir: str | Path, dtype: str = "bf16", overwrite: bool = False) -> Path:
    """Consolidate the latest checkpoint's ZeRO shards into one drafter directory in the
    public DFlash layout (config.json + model.safetensors)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dflash.checkpoint import save_drafter

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty")
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / STATE_NAME).read_text())
    with weights_only_loads():  # a crafted run directory must not run code here
        full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt / DS_DIR), tag=DS_TAG)
    prefix = "drafter."
    weights = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    drafter = DFlashDrafter(DrafterConfig.from_hf_dict(state["drafter_config"]))
    drafter.load_state_dict(weights, strict=True)
    fold_tap_scale(drafter, full.get("tap_scale"))
    head = None
    if drafter.draft_vocab is not None:  # vLLM's layout stores the target head's rows for the draft vocabulary
        from dflash.target import load_target

        head = load_target(state["train_config"]["target"], dtype="fp32").model.lm_head.weight
    if out.exists():
        shutil.rmtree(out)
    meta = {"step": state["step"], "checkpoint": str(ckpt), "train_config": state["train_config"]}
    return save_drafter(drafter, out, dtype=dtype, extra_files={"training.json": json.dumps(meta, indent=1)},
                        lm_head_weight=head)
