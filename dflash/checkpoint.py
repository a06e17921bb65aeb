"""Drafter checkpoints in the public DFlash layout: config.json + model.safetensors.

The directory is what vLLM (0.32, method "dflash") and SGLang load: weight names
layers.N.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm, fc, hidden_norm, norm. The drafter drafts
with the target's embedding and LM head, so neither is stored, except that a reduced
draft vocabulary (the K target tokens the drafter may draft) is stored the way vLLM
stores one:

    config.json       top-level "draft_vocab_size": K
    d2t               (K,) int64, target id = draft id + d2t[draft id]
    lm_head.weight    (K, D) the target head's rows for those K tokens, in draft-id order

Worked example, K=3, draftable target ids [5, 9, 40]: d2t = [5-0, 9-1, 40-2] = [5, 8, 38]
and lm_head.weight = target_head[[5, 9, 40]].

Reading also accepts what other producers and older versions of this project wrote: the
previous reduced-vocabulary layout (a `draft_vocab` id tensor, dflash_config.
draft_vocab_size), a full-vocabulary lm_head.weight or an embed_tokens.weight that copy the
target's (checked against the target when one is given, then dropped: a drafter with a
head of its own is refused), and a `mask_embedding.pt` next to the weights (a (D,) tensor,
or {"embedding": (D,), "mask_token_id": id}) that replaces the target's embedding of the
mask slots. Weights load from safetensors only; the one .pt file is read with
torch.load(weights_only=True).
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
MASK_EMBEDDING_NAME = "mask_embedding.pt"
D2T, HEAD, EMBED, OLD_VOCAB = "d2t", "lm_head.weight", "embed_tokens.weight", "draft_vocab"
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
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
                 extra_files: dict[str, str] | None = None, lm_head_weight: torch.Tensor | None = None) -> Path:
    """Write config.json + model.safetensors (weights cast to `dtype`), in the layout vLLM loads.

    A drafter with a draft vocabulary also writes d2t and lm_head.weight: the rows of
    `lm_head_weight` for its vocabulary, given as the target's whole LM head (V, D) or as
    those K rows already (K, D), in the order of drafter.draft_vocab. When it is not given,
    the head of the target named by the drafter's target_id is read (the default target
    only: pass it for any other). A mask embedding is written as mask_embedding.pt."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dt = parse_dtype(dtype)
    cfg = drafter.config.to_hf_dict()
    cfg["dtype"] = _DTYPE_NAMES[dt]
    state = {k: v.detach().to("cpu", dt) for k, v in drafter.state_dict().items() if k != OLD_VOCAB}
    if drafter.draft_vocab is not None:
        ids = drafter.draft_vocab.detach().cpu().long()
        head = lm_head_weight if lm_head_weight is not None else target_head_weight(drafter.config.target_id)
        head = head.detach().to("cpu")
        c = drafter.config
        if head.shape == (c.vocab_size, c.hidden_size):
            head = head.index_select(0, ids)
        elif head.shape != (c.draft_vocab_size, c.hidden_size):
            raise CheckpointError(f"lm_head_weight {tuple(head.shape)} is neither the target's head ({c.vocab_size}, "
                                  f"{c.hidden_size}) nor its rows for the draft vocabulary ({c.draft_vocab_size}, "
                                  f"{c.hidden_size})")
        state[D2T] = ids - torch.arange(ids.numel())
        state[HEAD] = head.to(dt)
    state = {k: v.contiguous() for k, v in state.items()}
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / WEIGHTS_NAME)
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
    if drafter.mask_embedding is not None:
        torch.save(drafter.mask_embedding.detach().to("cpu", dt).clone(), out / MASK_EMBEDDING_NAME)
    else:
        (out / MASK_EMBEDDING_NAME).unlink(missing_ok=True)
    for name, text in (extra_files or {}).items():
        (out / name).write_text(text)
    return out


def target_head_weight(target_id: str) -> torch.Tensor:
    """(V, D) fp32 LM head of the target a drafter names, when its id says how to load it
    (the default target, "default:..."); CheckpointError otherwise."""
    if not target_id.startswith("default:"):
        raise CheckpointError(f"a drafter with a draft vocabulary stores the target head's rows: pass "
                              f"lm_head_weight (the LM head of target {target_id or '(unnamed)'})")
    from dflash.target import load_target

    return load_target("default", dtype="fp32").model.lm_head.weight


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
    """Load a drafter directory (any layout the module docstring lists); with `target`,
    refuse one made for another target, or one whose stored head is not the target's."""
    path = Path(path)
    cfg = read_drafter_config(path)
    if target is not None:
        from dflash.config import check_drafter_fits

        try:
            check_drafter_fits(cfg, target)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"{path}: missing {WEIGHTS_NAME}")
    state = load_file(str(weights))
    draft_vocab = _draft_vocab(path, cfg, state, target)
    model = DFlashDrafter(cfg)
    if draft_vocab is not None:
        state[OLD_VOCAB] = draft_vocab
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
    model.set_mask_embedding(_read_mask_embedding(path, cfg))
    return model.to(device=device, dtype=parse_dtype(dtype)).eval()


def _draft_vocab(path: Path, cfg: DrafterConfig, state: dict, target) -> torch.Tensor | None:
    """Pop the vocabulary tensors (d2t, lm_head.weight, embed_tokens.weight, draft_vocab) from
    `state`; return the sorted draftable target ids, or None for the full vocabulary."""
    ids = None
    if D2T in state:
        d2t = state.pop(D2T)
        if d2t.dtype.is_floating_point or d2t.dim() != 1:
            raise CheckpointError(f"{path}: d2t must be a 1-D integer tensor, is {d2t.dtype} {tuple(d2t.shape)}")
        ids = torch.arange(d2t.numel()) + d2t.long()
    if OLD_VOCAB in state:
        if ids is not None:
            raise CheckpointError(f"{path}: both d2t and draft_vocab: a checkpoint names its vocabulary once")
        ids = state.pop(OLD_VOCAB).long()
    k = cfg.draft_vocab_size
    if (ids is None) != (k == 0) or (ids is not None and ids.numel() != k):
        raise CheckpointError(f"{path}: config says draft_vocab_size {k or cfg.vocab_size} but the weights hold "
                              f"{'no d2t' if ids is None else f'{ids.numel()} draft ids'}")
    if ids is not None and (ids.unique().numel() != k or int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise CheckpointError(f"{path}: the draft vocabulary must be {k} distinct ids below {cfg.vocab_size}")
    for name, rows in ((HEAD, ids), (EMBED, None)):
        copy = state.pop(name, None)
        if copy is None:
            continue
        n = cfg.vocab_size if rows is None else k
        if copy.shape != (n, cfg.hidden_size):
            raise CheckpointError(f"{path}: {name} {tuple(copy.shape)} should be ({n}, {cfg.hidden_size})")
        if getattr(target, "model", None) is not None:  # a loaded Target (a TargetInfo has no weights)
            module = target.model.lm_head if name == HEAD else target.model.get_input_embeddings()
            _check_target_copy(path, name, copy, module.weight, rows)
    return None if ids is None else ids.sort().values


def _check_target_copy(path: Path, name: str, copy: torch.Tensor, weight: torch.Tensor, rows) -> None:
    """The drafter drafts with the target's own head and embedding: a stored copy must equal
    them up to the rounding of the lower of the two precisions."""
    ref = weight.detach().to("cpu")
    ref = ref if rows is None else ref.index_select(0, rows)
    low = copy.dtype if torch.finfo(copy.dtype).bits < torch.finfo(ref.dtype).bits else ref.dtype
    a, b = copy.to(low).float(), ref.to(low).float()
    if not torch.allclose(a, b, rtol=2 ** -7, atol=1e-6):
        raise CheckpointError(f"{path}: {name} is not the target's (max difference {(a - b).abs().max():.3g}); "
                              f"a DFlash drafter here drafts with the target's frozen embedding and head")


def _read_mask_embedding(path: Path, cfg: DrafterConfig) -> torch.Tensor | None:
    file = path / MASK_EMBEDDING_NAME
    if not file.is_file():
        return None
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling refusal is the file's fault
        raise CheckpointError(f"{file}: not a tensor file torch.load(weights_only=True) reads: {e}") from e
    if isinstance(obj, dict):
        if obj.get("mask_token_id", cfg.mask_token_id) != cfg.mask_token_id:
            raise CheckpointError(f"{file}: made for mask_token_id {obj['mask_token_id']}, the config says "
                                  f"{cfg.mask_token_id}")
        obj = obj.get("embedding")
    if not isinstance(obj, torch.Tensor) or obj.numel() != cfg.hidden_size or not obj.is_floating_point():
        raise CheckpointError(f"{file}: expected {cfg.hidden_size} float values (or a dict with 'embedding')")
    return obj.reshape(-1)
