"""The distilled-data contract shared by distillation (writer) and training (reader).

One Parquet row per sample, standard Arrow types only, so plain pyarrow reads a whole
output directory:

    sample_id   string                     stable hash of the source conversation
    input_ids   list<int32>                prompt + responses, template tokens
    loss_mask   list<uint8>                1 on assistant tokens (end-of-turn too)
    num_tokens  int32                      len(input_ids)
    hidden      list<fixed_size_list<float16, n_taps*D>>   optional: tapped layer outputs
    target_ids  list<int32>                teacher-forced data only: the target's greedy
                                           token at each position, given the tokens before
                                           it (position 0: input_ids[0])

Two kinds of responses (metadata `responses`):
    regenerated  the target wrote them (greedy or sampled): input_ids are the labels
    source       the source's own replies, teacher-forced: one target pass gives the
                 features and target_ids, which are the labels; a block position is
                 scored only while the source tokens before it in the block equal the
                 target's own (dflash.masks.block_labels). ~40x cheaper per token on a
                 CPU than regenerating, at the price of blocks that leave the target's path.

Every file carries the same JSON metadata under the b"dflash" key (`DatasetMetadata`).
Training reads it back with `check_dataset` and refuses data made for another target,
other tapped layers, another hidden size or another format version: the most common way
to train a drafter that accepts nothing at serve time.

Also here: conversation normalisation (ShareGPT, chat messages, bare prompts) with
reject reasons, and the deterministic train / held-out split. No Ray, no model.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1
METADATA_KEY = b"dflash"
FEATURE_DTYPE = "float16"

# Reject reasons (the keys of the manifest's reject counts).
MALFORMED = "malformed"  # not a mapping / unknown layout / unknown role / unparsable line
EMPTY = "empty"  # no user turn, or an empty user message
NON_TEXT = "non_text"  # content that is not text (images, audio, numbers, ...)
TOO_LONG = "too_long"  # first prompt + response budget over the context budget
DUPLICATE = "duplicate"  # same conversation already seen earlier in the source

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "model": "assistant",
          "system": "system"}


class Reject(ValueError):
    """A source record that cannot become a sample; `reason` is one of the constants above."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DataMismatchError(ValueError):
    """A dataset that was made for another target/layers/format than the one asked for."""


# --- conversations ------------------------------------------------------------------------

def _text(content: Any) -> str:
    """Message content -> text. OpenAI-style part lists are joined when every part is text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise Reject(NON_TEXT, f"content part of type {kind!r}")
        return "".join(parts)
    raise Reject(NON_TEXT, f"content of type {type(content).__name__}")


def normalize_conversation(record: Any) -> list[dict]:
    """Any supported source record -> [{"role": system|user|assistant, "content": str}, ...].

    Layouts: ShareGPT {"conversations": [{"from": "human"|"gpt"|..., "value": str}]},
    chat {"messages": [{"role", "content"}]}, bare {"prompt": str}. Consecutive messages of
    the same role are merged (ShareGPT has human,human runs). Raises Reject.
    """
    if not isinstance(record, dict):
        raise Reject(MALFORMED, f"record is a {type(record).__name__}, not a mapping")
    if "prompt" in record and "messages" not in record and "conversations" not in record:
        text = _text(record["prompt"])
        turns = [("user", text)]
    else:
        if "messages" in record:
            raw, role_key, text_key = record["messages"], "role", "content"
        elif "conversations" in record:
            raw, role_key, text_key = record["conversations"], "from", "value"
        else:
            raise Reject(MALFORMED, f"no 'messages', 'conversations' or 'prompt' key (keys: {sorted(record)[:5]})")
        if not isinstance(raw, list):
            raise Reject(MALFORMED, "conversation is not a list")
        turns = []
        for m in raw:
            if not isinstance(m, dict) or role_key not in m or text_key not in m:
                raise Reject(MALFORMED, f"message without {role_key!r}/{text_key!r}")
            role = _ROLES.get(str(m[role_key]).lower())
            if role is None:
                raise Reject(MALFORMED, f"unknown role {m[role_key]!r}")
            turns.append((role, _text(m[text_key])))
    messages: list[dict] = []
    for role, text in turns:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": role, "content": text})
    users = [m for m in messages if m["role"] == "user"]
    if not users:
        raise Reject(EMPTY, "no user turn")
    if any(not m["content"].strip() for m in users):
        raise Reject(EMPTY, "empty user message")
    if any(m["role"] == "system" for m in messages[1:]):
        raise Reject(MALFORMED, "system message after the first turn")
    return messages


def prompt_turns(messages: list[dict]) -> tuple[str | None, list[str]]:
    """Normalised conversation -> (system text or None, user turns). Assistant turns of the
    source are dropped: the target regenerates them."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    return system, [m["content"] for m in messages if m["role"] == "user"]


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def sample_id(messages: list[dict]) -> str:
    """Stable id of a normalised source conversation: sha256 of its canonical JSON (32 hex).

    The same conversation gets the same id whatever layout it came in, on every machine.
    """
    return hashlib.sha256(b"conv:" + _canonical(messages)).hexdigest()[:32]


def raw_record_id(record: Any) -> str:
    """Id of a record that could not be normalised (for the rejects file)."""
    return hashlib.sha256(b"raw:" + _canonical(record)).hexdigest()[:32]


def split_of(sid: str, heldout_fraction: float) -> str:
    """Deterministic split by id: 'heldout' for ~heldout_fraction of ids, else 'train'."""
    return "heldout" if int(sid[:8], 16) < heldout_fraction * 2**32 else "train"


# --- schema and metadata --------------------------------------------------------------------

RESPONSES = ("regenerated", "source")


def distill_schema(hidden_width: int | None, target_ids: bool = False) -> pa.Schema:
    """Arrow schema of a shard; hidden_width = n_taps * D, or None for tokens-only data;
    target_ids for teacher-forced ("source") data."""
    fields = [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ]
    if hidden_width is not None:
        fields.append(pa.field("hidden", pa.list_(pa.list_(pa.float16(), hidden_width)), nullable=False))
    if target_ids:
        fields.append(pa.field("target_ids", pa.list_(pa.int32()), nullable=False))
    return pa.schema(fields)


@dataclass(frozen=True)
class DatasetMetadata:
    """What a distilled dataset was made from; identical in every file of a directory."""

    target_id: str
    weights_hash: str
    num_target_layers: int
    hidden_size: int
    target_layer_ids: tuple[int, ...]  # empty when features == "none"
    features: str  # "taps" | "none"
    compute_dtype: str  # dtype the target ran in (features are stored as FEATURE_DTYPE)
    chat_template_hash: str
    generation: dict = field(default_factory=dict, hash=False)
    feature_dtype: str = FEATURE_DTYPE
    format_version: int = FORMAT_VERSION
    responses: str = "regenerated"  # RESPONSES: "source" = teacher-forced, with target_ids

    def __post_init__(self):
        if self.responses not in RESPONSES:
            raise DataMismatchError(f"responses must be one of {RESPONSES}, got {self.responses!r}")

    @property
    def hidden_width(self) -> int | None:
        return len(self.target_layer_ids) * self.hidden_size if self.features == "taps" else None

    def schema(self) -> pa.Schema:
        return distill_schema(self.hidden_width, self.responses == "source").with_metadata(self.encode())

    def encode(self) -> dict[bytes, bytes]:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        if d["responses"] == "regenerated":  # the original kind: its files (and run fingerprints) stay as they were
            del d["responses"]
        return {METADATA_KEY: _canonical(d)}

    @classmethod
    def decode(cls, metadata: dict[bytes, bytes] | None, where: str = "file") -> "DatasetMetadata":
        if not metadata or METADATA_KEY not in metadata:
            raise DataMismatchError(f"{where} has no dflash metadata: not written by `dflash distill`")
        d = json.loads(metadata[METADATA_KEY])
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise DataMismatchError(f"{where} has format version {version}; this code reads {FORMAT_VERSION}")
        d["target_layer_ids"] = tuple(d["target_layer_ids"])
        return cls(**d)


def shard_files(directory: str | Path) -> list[Path]:
    """The finished shards of a dataset directory (temporary files start with '.')."""
    return sorted(p for p in Path(directory).glob("*.parquet") if not p.name.startswith((".", "_")))


def read_dataset_metadata(directory: str | Path) -> DatasetMetadata:
    """Metadata of a dataset directory; every shard must agree."""
    files = shard_files(directory)
    if not files:
        raise FileNotFoundError(f"no .parquet shards in {directory}")
    first = DatasetMetadata.decode(pq.read_schema(files[0]).metadata, str(files[0]))
    for f in files[1:]:
        other = DatasetMetadata.decode(pq.read_schema(f).metadata, str(f))
        if other != first:
            raise DataMismatchError(f"{f} was made with other settings than {files[0]}: one directory, one run")
    return first


def check_dataset(
    directory: str | Path,
    *,
    target_id: str | None = None,
    weights_hash: str | None = None,
    target_layer_ids: tuple[int, ...] | list[int] | None = None,
    hidden_size: int | None = None,
    require_hidden: bool = False,
) -> DatasetMetadata:
    """Read a dataset's metadata and refuse it if it does not fit the model being trained.

    Every argument left None is not checked. The error names each mismatch, e.g.
    "target_layer_ids: data has [1, 14, 27], expected [1, 8, 14, 20, 27]".
    """
    meta = read_dataset_metadata(directory)
    problems = []
    if target_id is not None and meta.target_id != target_id:
        problems.append(f"target_id: data has {meta.target_id!r}, expected {target_id!r}")
    if weights_hash is not None and meta.weights_hash != weights_hash:
        problems.append(f"weights_hash: data has {meta.weights_hash!r}, expected {weights_hash!r}")
    if hidden_size is not None and meta.hidden_size != hidden_size:
        problems.append(f"hidden_size: data has {meta.hidden_size}, expected {hidden_size}")
    if require_hidden and meta.features != "taps":
        problems.append("features: data holds tokens only (features=none); train online or redistill")
    if target_layer_ids is not None and meta.features == "taps" and tuple(meta.target_layer_ids) != tuple(target_layer_ids):
        problems.append(f"target_layer_ids: data has {list(meta.target_layer_ids)}, expected {list(target_layer_ids)}")
    if problems:
        raise DataMismatchError(f"dataset {directory} does not fit: " + "; ".join(problems))
    return meta


# --- rows <-> Arrow ---------------------------------------------------------------------------

def _offsets(lengths: list[int]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32), pa.int32())


def build_table(
    meta: DatasetMetadata,
    sample_ids: list[str],
    input_ids: list[list[int]],
    loss_masks: list[list[int]],
    hidden: list[np.ndarray] | None = None,
    target_ids: list[list[int]] | None = None,
) -> pa.Table:
    """Rows -> a Table with the exact shard schema (explicit standard Arrow types, so every
    file of a directory agrees and plain pyarrow reads them together).

    hidden: per sample (num_tokens, n_taps*D) float16, or None when meta.features == "none".
    target_ids: per sample, as long as input_ids, exactly when meta.responses == "source".
    """
    lengths = [len(s) for s in input_ids]
    if [len(m) for m in loss_masks] != lengths:
        raise ValueError("loss_mask and input_ids lengths differ")
    offsets = _offsets(lengths)
    cols = [
        pa.array(sample_ids, pa.string()),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(input_ids).astype(np.int32), pa.int32())),
        pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(loss_masks).astype(np.uint8), pa.uint8())),
        pa.array(lengths, pa.int32()),
    ]
    width = meta.hidden_width
    if width is not None:
        if hidden is None or [h.shape for h in hidden] != [(n, width) for n in lengths]:
            raise ValueError(f"hidden must be one (num_tokens, {width}) array per sample")
        flat = pa.array(np.concatenate([h.reshape(-1) for h in hidden]).astype(np.float16), pa.float16())
        cols.append(pa.ListArray.from_arrays(offsets, pa.FixedSizeListArray.from_arrays(flat, width)))
    if (target_ids is not None) != (meta.responses == "source"):
        raise ValueError("target_ids are given exactly for teacher-forced (responses 'source') data")
    if target_ids is not None:
        if [len(t) for t in target_ids] != lengths:
            raise ValueError("target_ids and input_ids lengths differ")
        cols.append(pa.ListArray.from_arrays(offsets, pa.array(np.concatenate(target_ids).astype(np.int32), pa.int32())))
    return pa.Table.from_arrays(cols, schema=meta.schema())


def hidden_arrays(table: pa.Table) -> list[np.ndarray]:
    """The `hidden` column -> per sample (num_tokens, n_taps*D) float16 (zero-copy views)."""
    col = table.column("hidden").combine_chunks()
    width = col.type.value_type.list_size
    flat = col.flatten().flatten().to_numpy(zero_copy_only=False).reshape(-1, width)  # (sum T, W)
    offs = col.offsets.to_numpy()
    offs = offs - offs[0]
    return [flat[offs[i]: offs[i + 1]] for i in range(len(col))]


# --- files ------------------------------------------------------------------------------------

MANIFEST_NAME = "_manifest.json"  # "_" prefix: pyarrow's directory discovery skips it
REJECTS_NAME = "_rejects.jsonl"


def shard_name(index: int) -> str:
    """Deterministic file name of shard `index` (shards hold consecutive planned samples)."""
    return f"part-{index:05d}.parquet"


def write_shard(table: pa.Table, path: str | Path) -> int:
    """Write a shard so that readers never see a partial file: a hidden temporary name in the
    same directory, fsync, then an atomic rename. Returns the file size in bytes.

    zstd everywhere; the fp16 features also get BYTE_STREAM_SPLIT (the high and low bytes
    of every value stored apart), which zstd compresses far better than interleaved halves.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    split_cols = ["hidden.list.element.list.element"] if "hidden" in table.column_names else False
    pq.write_table(table, tmp, compression="zstd", use_dictionary=["sample_id"],
                   use_byte_stream_split=split_cols, row_group_size=64)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path.stat().st_size
