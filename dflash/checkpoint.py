"""Drafter checkpoints in the public DFlash layout: config.json + model.safetensors.

The directory is what vLLM and SGLang load with their dflash speculative method: weight
names layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm, fc, hidden_norm, norm. No embedding and no LM
head are stored (the target's are used). Loading reads safetensors only, never pickles.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.config import DrafterConfig
from dflash.drafter import DFlashDrafter
from dflash.target import parse_dtype

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# Reference drafters shipped inside the package, one directory per target id.
REFERENCE_DRAFTERS = Path(__file__).parent / "drafters"


class CheckpointError(ValueError):
    """A drafter directory that cannot be used, with the reason."""


def reference_drafter_dir(target_id: str) -> Path | None:
    """The shipped reference drafter for `target_id` ("default:SmolLM2-135M-Instruct" or
    a model directory's name), or None when none ships for it."""
    path = REFERENCE_DRAFTERS / target_id.rsplit(":", 1)[-1]
    return path if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file() else None


NO_DRAFTER = (None, "", "none")  # drafter specs that mean plain autoregressive decoding
NAMED_DRAFTERS = ("default", "auto")  # specs that name the shipped reference drafter


def is_drafter_directory_spec(spec: str | None) -> bool:
    """True when `spec` names a directory, i.e. is neither "no drafter" nor default/auto."""
    return spec not in NO_DRAFTER and spec not in NAMED_DRAFTERS


def resolve_drafter(spec: str | None, target_id: str) -> Path | None:
    """A drafter spec as users write it -> the directory to load, or None for plain
    autoregressive decoding.

    None/""/"none": no drafter. "default": the reference drafter shipped for `target_id`
    (CheckpointError when none ships). "auto": that drafter when one ships, else None, so a
    default that names it still works on every target. Anything else: a directory."""
    if spec in NO_DRAFTER:
        return None
    if spec in NAMED_DRAFTERS:
        ref = reference_drafter_dir(target_id)
        if ref is None and spec == "default":
            raise CheckpointError(f"no reference drafter ships for target {target_id}; pass a drafter directory")
        return ref
    return Path(spec).expanduser()


def save_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: str | torch.dtype = "bf16",
                 extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors (weights cast to `dtype`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dt = parse_dtype(dtype)
    cfg = drafter.config.to_hf_dict()
    cfg["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dt]
    # weights in `dtype`; index buffers (draft_vocab) keep their integer type
    state = {k: v.detach().to("cpu", dt if v.is_floating_point() else v.dtype).contiguous()
             for k, v in drafter.state_dict().items()}
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


def read_drafter_config(path: str | Path) -> DrafterConfig:
    path = Path(path)
    cfg_file = path / CONFIG_NAME
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: not a drafter directory (no {CONFIG_NAME})")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON: {e}") from e
    if "DFlashDraftModel" not in (raw.get("architectures") or []):
        raise CheckpointError(f"{cfg_file}: architectures {raw.get('architectures')} is not a DFlash drafter")
    try:
        return DrafterConfig.from_hf_dict(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def load_drafter(path: str | Path, target=None, device: str | torch.device = "cpu",
                 dtype: str | torch.dtype = "fp32") -> DFlashDrafter:
    """Load a drafter directory; with `target`, refuse one made for another target."""
    path = Path(path)
    cfg = read_drafter_config(path)
    if target is not None:
        from dflash.decoding import check_drafter_matches_target

        try:
            check_drafter_matches_target(cfg, target)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{path}: missing {WEIGHTS_NAME}")
    state = load_file(str(weights))
    model = DFlashDrafter(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config: missing {missing[:6]}"
                              f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}")
    bad = [f"{k} {tuple(state[k].shape)} != {tuple(v.shape)}" for k, v in expected.items() if state[k].shape != v.shape]
    if bad:
        raise CheckpointError(f"{path}: weight shapes do not match the config: {bad[:4]}")
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=parse_dtype(dtype)).eval()
