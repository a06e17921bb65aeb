"""The Ray Data actor of distillation: one shard in, one finished Parquet file out.

Lives in the installed package (not in a test or script) so Ray workers can import it.
Each input row is a whole shard (its index and its samples as JSON); the actor regenerates
the shard's conversations in micro-batches of `batch_size` and taps the target's hidden
states (with `responses: source`: teacher-forces the source's replies, one pass each),
then writes the shard with dflash.data.write_shard (temporary name + atomic rename). It
returns only a small summary row, so nothing heavy crosses the object store.

Why files are written here rather than by Dataset.write_parquet: a shard's file name is
fixed by its index, so a retried task (actor killed, node lost) or a rerun after a driver
crash rewrites the same name with the same content. That is what makes the job
idempotent and resumable; write_parquet names files per execution.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dflash.data import DatasetMetadata, build_table, shard_name, write_shard
from dflash.regenerate import GenerationParams, regenerate, tapped_hidden
from dflash.teacher_forcing import source_sequence, teacher_forced

SUMMARY_SCHEMA = pa.schema([
    ("shard", pa.int64()), ("samples", pa.int64()), ("tokens", pa.int64()),
    ("loss_tokens", pa.int64()), ("bytes", pa.int64()), ("seconds", pa.float64()),
])


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor needs (picklable; built once by the driver)."""

    target: str
    dtype: str
    device: str
    output_dir: str
    metadata: DatasetMetadata
    params: GenerationParams
    seed: int
    batch_size: int
    torch_threads: int = 1
    engine: str = "native"  # "vllm": responses by vLLM (pipelines/vllm_generate.py), features by us


class ShardDistiller:
    """Ray Data callable class: __init__ loads the target once, __call__ maps shard rows."""

    def __init__(self, spec: WorkerSpec):
        import torch

        from dflash.target import load_target

        torch.set_num_threads(spec.torch_threads)  # oversubscribed threads are catastrophic on shared cores
        self.spec = spec
        self.target = load_target(spec.target, device=spec.device, dtype=spec.dtype)
        if self.target.weights_hash != spec.metadata.weights_hash:
            raise RuntimeError(f"target {spec.target!r} on this node has weights {self.target.weights_hash}, "
                               f"the driver planned with {spec.metadata.weights_hash}: nodes disagree")
        self.generate = None  # dflash.regenerate.generate_batch: our decode loop
        if spec.engine == "vllm":
            from dflash.target import resolve_target_dir
            from pipelines.vllm_generate import VllmGenerator

            self.generate = VllmGenerator(resolve_target_dir(spec.target)[0], spec.dtype, spec.params.max_seq_len,
                                          spec.batch_size, self.target.stop_token_ids, threads=spec.torch_threads)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = [self.distill_shard(r["shard"], json.loads(r["samples"])) for r in batch.to_pylist()]
        return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)

    def distill_shard(self, index: int, samples: list[dict]) -> dict:
        """samples: [{"sample_id", "system", "users"}] (+ "messages" for responses
        source) -> writes part-<index>.parquet."""
        t0 = time.perf_counter()
        path = Path(self.spec.output_dir) / shard_name(index)
        if path.exists():  # a retry of a task whose file was already renamed into place
            counts = pq.read_table(path, columns=["num_tokens", "loss_mask"])
            return self._summary(index, counts, path.stat().st_size, t0)
        if self.spec.metadata.responses == "source":
            table = self.teacher_force(samples)
            return self._summary(index, table, write_shard(table, path), t0)
        meta, ids, seqs, masks, hidden = self.spec.metadata, [], [], [], []
        for start in range(0, len(samples), self.spec.batch_size):
            part = samples[start: start + self.spec.batch_size]
            key = hashlib.sha256(",".join(s["sample_id"] for s in part).encode()).hexdigest()[:16]
            out = regenerate(self.target, [(s["system"], s["users"]) for s in part],
                             self.spec.params, seed=self.spec.seed, key=key, generate=self.generate)
            ids += [s["sample_id"] for s in part]
            seqs += [o[0] for o in out]
            masks += [o[1] for o in out]
            if meta.features == "taps":
                hidden += tapped_hidden(self.target, [o[0] for o in out], meta.target_layer_ids)
        table = build_table(meta, ids, seqs, masks, hidden if meta.features == "taps" else None)
        size = write_shard(table, path)
        return self._summary(index, table, size, t0)

    def teacher_force(self, samples: list[dict]) -> pa.Table:
        """samples with their source "messages" -> the shard's table: one target pass per
        conversation gives its features and labels (dflash/teacher_forcing.py)."""
        meta, params, tok = self.spec.metadata, self.spec.params, self.target.tokenizer
        seqs, masks, hidden, labels = [], [], [], []
        for s in samples:
            ids, mask = source_sequence(tok, s["messages"], self.target.stop_token_ids, params.max_seq_len,
                                        params.thinking)
            taps, target_ids = teacher_forced(self.target, ids, meta.target_layer_ids)
            seqs.append(ids)
            masks.append(mask)
            hidden.append(taps)
            labels.append(target_ids)
        return build_table(meta, [s["sample_id"] for s in samples], seqs, masks,
                           hidden if meta.features == "taps" else None, labels)

    @staticmethod
    def _summary(index: int, table: pa.Table, size: int, t0: float) -> dict:
        loss = pc.sum(pc.list_flatten(table.column("loss_mask")).cast(pa.int64())).as_py() or 0
        return {"shard": index, "samples": table.num_rows, "bytes": size, "loss_tokens": loss,
                "tokens": pc.sum(table.column("num_tokens")).as_py() or 0,
                "seconds": time.perf_counter() - t0}
