"""Drafter configuration: the few numbers that define a DFlash drafter.

A drafter is shaped by its target: hidden size, heads and FFN width are copied from the
target so that the target's embedding and LM head fit it unchanged, and the tapped layer
ids and mask token name rows/layers of that one target. `DrafterConfig.for_target` derives
all of that from a Hugging Face config; `to_hf_dict`/`from_hf_dict` read and write the
public DFlash drafter layout (the config.json that vLLM and SGLang load).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dflash.target import choose_mask_token_id

# Loss decay constants from the paper: gamma by block size.
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The paper's tap rule: spread n taps uniformly from layer 1 to layer N-3.

    Worked example: N=36, n=5 -> round(1 + i*32/4) = [1, 9, 17, 25, 33].
    SmolLM2 (N=30), n=5 -> round(1 + i*6.5) = [1, 8, 14, 20, 27] (Python's round:
    half to even); n=3 -> [1, 14, 27]; n=1 -> [15].
    """
    if num_taps < 1:
        raise ValueError(f"num_taps must be >= 1, got {num_taps}")
    if num_target_layers < 4:
        raise ValueError(f"target needs at least 4 layers to tap, has {num_target_layers}")
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_taps - 1))) for i in range(num_taps)]


def check_decode_block_size(decode_block_size: int, block_size: int) -> None:
    """0 (decode at the trained block) or 2..block_size: positions past B were never trained."""
    if decode_block_size and not 2 <= decode_block_size <= block_size:
        raise ValueError(f"decode_block_size must be 0 (= block_size) or in 2..{block_size}, got {decode_block_size}")


def default_gamma(block_size: int) -> float:
    """Loss decay gamma: 7/5/4 for B=16/10/8 (paper); other sizes interpolate ~B/2.3."""
    return _GAMMA_BY_BLOCK.get(block_size, max(1.0, round(block_size / 2.3, 2)))


# config.json fields from_hf_dict reads ...
_HF_FIELDS = frozenset({
    "architectures", "model_type", "block_size", "dflash_config", "draft_vocab_size", "dflash_ray",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "num_target_layers", "num_hidden_layers", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "max_position_embeddings", "hidden_act", "attention_bias", "use_sliding_window", "sliding_window",
    "layer_types"})
# ... and those that do not change what the drafter computes here: bookkeeping of
# transformers and the hub, token ids of the target, training-only values, code for
# trust_remote_code (never run), fields that only matter with a sliding window
_HF_IGNORED = frozenset({
    "dtype", "torch_dtype", "transformers_version", "_name_or_path", "auto_map", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "attention_dropout", "initializer_range", "tie_word_embeddings",
    "max_window_layers"})


def _check_unsupported(d: dict) -> None:
    """Known fields set to what this drafter does not implement (see from_hf_dict)."""
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r}: the drafter here implements silu (SwiGLU) only")
    if d.get("use_sliding_window"):
        raise ValueError("use_sliding_window true: the drafter here attends to its whole context")
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"layer_types {sorted(layer_types)}: the drafter here has full attention layers only")
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{key} of type {kind!r}: the drafter here implements plain RoPE only")


@dataclass(frozen=True)
class DrafterConfig:
    """Everything needed to build a drafter for one target.

    hidden_size .. rope_theta mirror the target (Qwen3-style layer fields);
    num_hidden_layers is the drafter's own depth; target_layer_ids are output indices of
    target decoder layers (0-based; the feature of layer l is hidden_states[l+1]).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_hidden_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    attention_bias: bool = False
    # > 0: the drafter scores only this many target tokens (the most frequent in its
    # training data, ids in the `draft_vocab` buffer; on disk, vLLM's d2t + lm_head.weight,
    # see dflash.checkpoint); 0: the whole target vocabulary.
    # Lossless either way: the target verifies every drafted token.
    draft_vocab_size: int = 0
    # the block size decoding uses unless told otherwise; 0: block_size. A drafter trained
    # at B may decode at a smaller block: at low acceptance a shorter verify pays off
    decode_block_size: int = 0
    # informational: which target this drafter was built for (id + weights hash)
    target_id: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [l for l in self.target_layer_ids if not 0 <= l < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} out of range for a target with {self.num_target_layers} layers"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside vocabulary of {self.vocab_size}")
        if self.draft_vocab_size and not 2 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be 0 (all) or in 2..{self.vocab_size}, got {self.draft_vocab_size}")
        check_decode_block_size(self.decode_block_size, self.block_size)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        object.__setattr__(self, "target_layer_ids", tuple(int(l) for l in self.target_layer_ids))

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def gamma(self) -> float:
        return default_gamma(self.block_size)

    def replace(self, **changes) -> "DrafterConfig":
        return replace(self, **changes)

    @classmethod
    def for_target(
        cls,
        target,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        num_taps: int = 5,
        draft_vocab_size: int = 0,
        decode_block_size: int = 0,
        mask_token_id: int | None = None,
    ) -> "DrafterConfig":
        """A drafter shaped for `target`: a dflash.target.Target or TargetInfo (anything with
        .config, .tokenizer and .target_id). The layer shape is copied from its config; the
        mask token is chosen from its tokenizer (choose_mask_token_id) unless given."""
        tc = target.config
        if mask_token_id is None:
            mask_token_id = choose_mask_token_id(target.tokenizer, tc.vocab_size, target.target_id)
        n_layers = tc.num_hidden_layers
        heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        rope_theta = getattr(tc, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = (getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            hidden_size=tc.hidden_size,
            intermediate_size=tc.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=tc.vocab_size,
            num_target_layers=n_layers,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(n_layers, num_taps)),
            mask_token_id=mask_token_id,
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=getattr(tc, "max_position_embeddings", 8192),
            target_id=target.target_id,
            draft_vocab_size=draft_vocab_size,
            decode_block_size=decode_block_size,
        )

    # --- public DFlash drafter layout (config.json) -----------------------------------
    def to_hf_dict(self) -> dict:
        """config.json in the layout of the public DFlash drafters (Qwen3-style fields).

        A reduced draft vocabulary is the top-level "draft_vocab_size", as vLLM reads it
        (its d2t and lm_head.weight tensors are written by dflash.checkpoint).
        decode_block_size lives in our own `dflash_ray` section, which other loaders
        ignore: they decode at the block the user passes."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}),
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
            "dflash_ray": {"target_id": self.target_id,
                           **({"decode_block_size": self.decode_block_size} if self.decode_block_size else {}),
                           **self.extra},
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        """Read a drafter config.json: ours, the public z-lab layout or vLLM's. A field this
        project does not know, or a known one set to something the drafter here does not
        implement (sliding window, scaled RoPE, another activation), is an error naming it:
        silently ignoring it would decode with a different model than the one trained."""
        unknown = sorted(set(d) - _HF_FIELDS - _HF_IGNORED)
        if unknown:
            raise ValueError(f"unknown drafter config field(s) {unknown}: not part of the DFlash/Qwen3 layout "
                             f"this project reads")
        missing = [k for k in ("block_size", "dflash_config", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_target_layers", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"drafter config.json lacks required fields {missing}")
        dc = dict(d["dflash_config"])
        if not dc.get("use_aux_hidden_state", True):
            raise ValueError("dflash_config.use_aux_hidden_state false (no fc over target taps) is not a DFlash drafter "
                             "this project runs")
        unknown = sorted(set(dc) - {"mask_token_id", "target_layer_ids", "draft_vocab_size", "use_aux_hidden_state"})
        if unknown:
            raise ValueError(f"unknown dflash_config field(s) {unknown}")
        _check_unsupported(d)
        heads = d.get("num_attention_heads", 1)
        ours = dict(d.get("dflash_ray") or {})
        target_id = ours.pop("target_id", "")
        decode_block_size = ours.pop("decode_block_size", 0)
        rope_theta = d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        # vLLM's top-level field; older checkpoints of ours kept it in dflash_config.
        # Equal to the vocabulary (or absent): no reduced vocabulary
        draft_vocab_size = d.get("draft_vocab_size") or dc.get("draft_vocab_size") or 0
        if draft_vocab_size == d["vocab_size"]:
            draft_vocab_size = 0
        return cls(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            num_target_layers=d["num_target_layers"],
            target_layer_ids=tuple(dc["target_layer_ids"]),
            mask_token_id=dc["mask_token_id"],
            num_hidden_layers=d["num_hidden_layers"],
            block_size=d["block_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 8192),
            hidden_act=d.get("hidden_act", "silu"),
            attention_bias=d.get("attention_bias", False),
            draft_vocab_size=draft_vocab_size,
            decode_block_size=decode_block_size,
            target_id=target_id,
            extra=ours,
        )


def check_drafter_fits(cfg, target) -> None:
    """Refuse a drafter made for another target, naming the mismatch. cfg: a DrafterConfig
    (hidden_size, num_target_layers, vocab_size); target: anything with hidden_size,
    num_layers, vocab_size and target_id (a Target, or its metadata)."""
    problems = []
    if cfg.hidden_size != target.hidden_size:
        problems.append(f"hidden size {cfg.hidden_size} != target's {target.hidden_size}")
    if cfg.num_target_layers != target.num_layers:
        problems.append(f"made for a {cfg.num_target_layers}-layer target, this target has {target.num_layers}")
    if cfg.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {cfg.vocab_size} != target's {target.vocab_size}")
    if problems:
        raise ValueError(f"drafter does not fit target {target.target_id}: " + "; ".join(problems))
