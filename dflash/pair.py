"""One decoding pair: a target, its drafter and the draft sources, built from one config.

Every entry point that decodes (the CLI's generate and bench, a Serve replica, the demo,
the benchmarks) describes what it wants as a `DecodeConfig` and calls `load_pair`. So a new
decoding option is one field here, one flag in the CLI, and nothing else: ServeConfig and
DemoConfig embed these same fields.

    pair = load_pair(DecodeConfig(drafter="default", dtype="bf16"))
    req = pair.decoder.generate([ids], SamplingParams(64))[0]

What `load_pair` checks, once, before any decoding: the drafter fits the target (shape,
layers, vocabulary), the decode block is one the drafter was trained for (2..its
block_size; positions past it would be drafted by untrained slots), the corpus is made for
the target's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch

from dflash.checkpoint import CheckpointError, load_drafter, resolve_drafter
from dflash.config import DrafterConfig, check_decode_block_size, check_drafter_fits
from dflash.corpus import CorpusIndex, resolve_corpus
from dflash.decoding import SpeculativeDecoder
from dflash.drafter import DFlashDrafter
from dflash.lookup import LookupConfig
from dflash.sampling import VERIFY_RULES
from dflash.target import Target, load_target, parse_dtype
from dflash.tree import TreeConfig
from dflash.width import SPECULATION_MARGIN

DTYPES = ("auto", "bf16", "fp32", "fp16")


@dataclass(frozen=True)
class DecodeConfig:
    """What to decode with. Validated on construction; every stage embeds these fields."""

    target: str = "default"  # "default", a Hugging Face directory or a .gguf file
    # a drafter directory; "default": the reference drafter shipped for the target; "auto":
    # that one when the target has one (else `load_pair`'s fallback); "random": an untrained
    # one; None/"none": plain autoregressive decoding
    drafter: str | None = "auto"
    # "auto": bf16 where the device computes it natively, else fp32 (resolve_dtype)
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = "auto"
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    verify: Literal["rejection", "match"] = "rejection"  # the lossless rule at T > 0
    # 0 (default): adaptive width - each cycle verifies the width (1 .. the drafter's decode
    # block, or a copy's length) that the measured pass costs and the recent acceptance say
    # pays best (dflash.width); > 0: pin the drafter's block to this, every cycle (experiments)
    block_size: int = 0
    lookup: bool = True  # with a drafter: copy drafts from the context when it repeats (dflash.lookup)
    lookup_tokens: int = 7  # tokens per copied or corpus draft
    # corpus lookup (dflash.corpus): "auto" = the drafter directory's corpus/corpus.safetensors
    # when it has one; None/"none" = off; or a file made by `dflash corpus`
    corpus: str | None = "auto"
    tree_nodes: int = 0  # > 0: verify a draft tree of up to this many tokens a cycle (dflash.tree)
    # adaptive width: a speculative cycle must promise this fraction more tokens/s than an AR
    # step (dflash.width); 0 where a wide verify is nearly free (a GPU at small batch)
    speculation_margin: float = SPECULATION_MARGIN
    seed: int = 0  # initialises drafter="random"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")
        if self.block_size and self.block_size < 2:
            raise ValueError(f"block_size must be 0 (the drafter's) or >= 2, got {self.block_size}")
        if self.lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {self.lookup_tokens}")
        if self.tree_nodes < 0 or self.tree_nodes == 1:
            raise ValueError(f"tree_nodes must be 0 (off) or >= 2, got {self.tree_nodes}")
        if not 0 <= self.speculation_margin < 10:
            raise ValueError(f"speculation_margin must be in [0, 10), got {self.speculation_margin}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    @classmethod
    def of(cls, config, **changes) -> "DecodeConfig":
        """The decoding part of a config that embeds these fields (ServeConfig, DemoConfig)."""
        return cls(**{**{f.name: getattr(config, f.name) for f in fields(cls)}, **changes})


@dataclass
class DecodingPair:
    """What `load_pair` built: the decoder, and where its drafter and corpus came from."""

    decoder: SpeculativeDecoder
    drafter_source: str | None  # the drafter's directory, "random", or None (autoregressive)
    corpus_source: str | None  # the corpus file, or None
    dtype_reason: str = "asked for"  # why the target runs in its dtype (resolve_dtype)

    @property
    def target(self) -> Target:
        return self.decoder.target

    @property
    def drafter(self) -> DFlashDrafter | None:
        return self.decoder.drafter


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU has bf16 arithmetic (AVX512-BF16 or AMX-BF16). Without it, bf16
    matmuls are emulated: a 4-token verify costs ~2.4 one-token steps instead of ~1.1."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not Linux: no way to tell cheaply, keep the exact dtype
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def resolve_dtype(dtype: str, device: str, cpuinfo: str | None = None) -> tuple[str, str]:
    """DecodeConfig.dtype -> (the dtype to load, why). "auto" picks bf16 where the device
    computes it natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX), else
    fp32; any other value is kept as given."""
    if dtype != "auto":
        return dtype, "asked for"
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ("bf16", "the GPU supports bf16") if ok else ("fp32", "the GPU has no bf16")
    if cpu_has_native_bf16(cpuinfo):
        return "bf16", "the CPU has native bf16 (avx512_bf16/amx_bf16)"
    return "fp32", "the CPU has no native bf16 (no avx512_bf16/amx_bf16): bf16 would be emulated"


def random_drafter(target: Target, seed: int = 0, num_taps: int = 3, block_size: int = 16) -> DFlashDrafter:
    """An untrained drafter shaped for `target` (benchmarks of the machinery, not of acceptance)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, num_taps=num_taps, block_size=block_size)
    return DFlashDrafter(cfg).to(device=target.device, dtype=target.dtype).eval()


def _drafter(cfg: DecodeConfig, target: Target, fallback: str | None) -> tuple[DFlashDrafter | None, str | None]:
    spec = cfg.drafter
    if spec == "auto" and resolve_drafter(spec, target.target_id) is None:  # none ships for this target
        spec = fallback
    if spec == "random":
        return random_drafter(target, cfg.seed), "random"
    path = resolve_drafter(spec, target.target_id)  # CheckpointError for "default" when none ships
    if path is None:
        return None, None
    if not path.exists():
        raise FileNotFoundError(f"drafter directory not found: {spec}")
    return load_drafter(path, target=target, device=target.device, dtype=target.dtype), str(path)


def decode_block(cfg: DecodeConfig, drafter_config: DrafterConfig) -> int:
    """The block a drafter cycle verifies: cfg.block_size, else the drafter's decode block."""
    block = cfg.block_size or drafter_config.decode_block_size or drafter_config.block_size
    check_decode_block_size(block, drafter_config.block_size)
    return block


def build_decoder(cfg: DecodeConfig, target: Target, drafter: DFlashDrafter | None,
                  corpus: CorpusIndex | None = None) -> SpeculativeDecoder:
    """The decoder for an already-loaded target and drafter (a test's, a training run's)."""
    lookup = LookupConfig(num_tokens=cfg.lookup_tokens) if cfg.lookup and drafter is not None else None
    tree = TreeConfig(max_nodes=cfg.tree_nodes) if cfg.tree_nodes else None
    block = decode_block(cfg, drafter.config) if drafter is not None else None
    return SpeculativeDecoder(target, drafter, verify=cfg.verify, block_size=block, lookup=lookup,
                              corpus=corpus, tree=tree, adaptive=not cfg.block_size,
                              speculation_margin=cfg.speculation_margin)


def check_pair(cfg: DecodeConfig) -> None:
    """The checks of load_pair that need no weights: the drafter fits the target and the
    decode block is one it was trained for. Reads only config files, so a launcher can refuse
    a bad pair before starting any replica. Skipped for a drafter directory that is not on
    this machine (on a cluster it may live only on the workers; each replica checks again)."""
    from dflash.checkpoint import is_drafter_directory_spec, read_drafter_config
    from dflash.target import inspect_target

    if cfg.drafter in (None, "", "none", "random"):
        return
    if is_drafter_directory_spec(cfg.drafter) and not Path(cfg.drafter).expanduser().exists():
        return
    info = inspect_target(cfg.target)
    path = resolve_drafter(cfg.drafter, info.target_id)
    if path is None:  # "auto" on a target with no shipped drafter
        return
    drafter_config = read_drafter_config(path)
    try:
        check_drafter_fits(drafter_config, info)
        decode_block(cfg, drafter_config)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_pair(cfg: DecodeConfig, fallback: str | None = None, target: Target | None = None) -> DecodingPair:
    """Load the target (unless one is given, on the config's device and dtype), the drafter
    and the corpus; check they fit; build the decoder.

    fallback: what drafter="auto" means when no reference drafter ships for the target
    (None: autoregressive; "random": an untrained drafter, e.g. for bench).
    Raises FileNotFoundError or ValueError (CheckpointError among them), naming the problem."""
    dtype, dtype_reason = resolve_dtype(cfg.dtype, cfg.device)
    if target is None:
        target = load_target(cfg.target, device=cfg.device, dtype=dtype)
    elif cfg.dtype != "auto" and target.dtype != parse_dtype(dtype):
        raise ValueError(f"target is {target.dtype}, config asks for {cfg.dtype}")
    drafter, drafter_source = _drafter(cfg, target, fallback)
    corpus_dir = Path(drafter_source) if drafter_source not in (None, "random") else None
    corpus_path = resolve_corpus(cfg.corpus, corpus_dir)
    corpus = CorpusIndex.load(corpus_path, target.vocab_size, num_tokens=cfg.lookup_tokens) if corpus_path else None
    decoder = build_decoder(cfg, target, drafter, corpus)
    return DecodingPair(decoder, drafter_source, str(corpus_path) if corpus_path else None, dtype_reason)
