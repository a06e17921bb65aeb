"""Training data: check a distilled dataset against the model, stream it, bucket it.

The driver calls `inspect_training_data` before anything starts, so data made for another
target, other tapped layers, another hidden size or format version (dflash.data's
contract) is refused with a message naming the mismatch, and an empty dataset is an error
instead of a worker group waiting forever for its first batch.

Workers call `micro_batches` on their Ray Data shard. Length bucketing: rows arrive in
buffers of `micro_batch_size * bucket_batches`; each buffer is sorted by length and cut
into micro-batches, whose order is then shuffled with a seeded generator. Sequences of
similar length share a micro-batch, so padding stays small (the `pad_fraction` metric
shows how small) without any global sort.

Worked example, micro_batch_size 2, bucket_batches 2, lengths arriving [90, 12, 85, 15]:
sorted [12, 15, 85, 90] -> micro-batches [12, 15] and [85, 90] (pad 3 + 5 of 202 slots)
instead of [90, 12] and [85, 15] (pad 78 + 70 of 350).

Shuffling across shards: epoch e reads the shard files in order e % FILE_ORDERS, a seeded
permutation (order 0 is file order), through its own lazily read Ray Dataset, so which
rows share a buffer, and which rows a worker gets, changes from epoch to epoch without
materialising the data (a global shuffle or randomize_block_order would hold all of it
in the object store). The order of an epoch depends only on (seed, epoch): a resumed run
reads the same order and skips exactly the micro-batches it trained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from dflash.data import DataMismatchError, DatasetMetadata, check_dataset, shard_files
from dflash.training import collate, label_rows, most_frequent_tokens, read_rows, table_rows, token_counts

TOKEN_COLUMNS = ["input_ids", "loss_mask", "num_tokens"]


@dataclass(frozen=True)
class DataInfo:
    files: tuple[str, ...]
    num_rows: int
    metadata: DatasetMetadata


def inspect_training_data(directory: str, *, offline: bool, target_id: str, weights_hash: str,
                          num_target_layers: int, hidden_size: int,
                          target_layer_ids: tuple[int, ...] | None) -> DataInfo:
    """Refuse a dataset that does not fit the target/drafter; count its rows (file footers only).

    Offline training needs the stored features of exactly the drafter's tapped layers;
    online training needs only tokens from the same target (same tokenizer and chat template).
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"data directory not found: {directory}")
    meta = check_dataset(directory, target_id=target_id, weights_hash=weights_hash, hidden_size=hidden_size,
                         target_layer_ids=target_layer_ids if offline else None, require_hidden=offline)
    if meta.num_target_layers != num_target_layers:
        raise DataMismatchError(f"dataset {directory} does not fit: num_target_layers: data has "
                                f"{meta.num_target_layers}, expected {num_target_layers}")
    files = shard_files(directory)
    rows = sum(pq.read_metadata(f).num_rows for f in files)
    if rows == 0:
        raise ValueError(f"dataset {directory} is empty: {len(files)} shard(s), 0 rows")
    return DataInfo(tuple(str(f) for f in files), rows, meta)


def response_token_counts(info: DataInfo, vocab_size: int) -> np.ndarray:
    """(V,) how often each token id occurs among the response (loss) tokens of the data."""
    ids, masks, _ = read_rows(info.files)
    return token_counts(ids, masks, vocab_size)


def draft_vocabulary(info: DataInfo, vocab_size: int, k: int) -> tuple[tuple[int, ...], str]:
    """The k most frequent response tokens of the data (the drafter's draft vocabulary),
    and a line saying how much of the data they cover."""
    counts = response_token_counts(info, vocab_size)
    vocab = most_frequent_tokens(counts, k)
    covered = counts[list(vocab)].sum() / max(1, counts.sum())
    return vocab, (f"the {k} most frequent response tokens cover {covered:.1%} of the data's "
                   f"{int(counts.sum())} response tokens")


FILE_ORDERS = 4  # distinct per-epoch file orders; epoch e reads order e % FILE_ORDERS


def file_order(files, seed: int, order: int) -> list[str]:
    """Permutation `order` of the shard files: 0 is file order, the others seeded shuffles."""
    files = list(files)
    if order:
        random.Random(seed * 1_000_003 + order).shuffle(files)
    return files


def epoch_dataset_name(epoch: int, orders: int) -> str:
    """The Ray Train dataset an epoch reads (one per file order)."""
    return f"train{epoch % orders}"


def read_dataset(info: DataInfo, offline: bool, files=None):
    """A Ray Dataset over the shards (in the order given, default file order); online mode
    never reads the (large) hidden column; teacher-forced data brings its labels (target_ids)."""
    import ray

    columns = TOKEN_COLUMNS + (["hidden"] if offline else [])
    columns += ["target_ids"] if info.metadata.responses == "source" else []
    return ray.data.read_parquet(list(files or info.files)).select_columns(columns)


def epoch_datasets(info: DataInfo, offline: bool, seed: int, orders: int) -> dict:
    """{name: Ray Dataset} for each of the run's `orders` file orders (epoch_dataset_name)."""
    return {epoch_dataset_name(k, orders): read_dataset(info, offline, file_order(info.files, seed, k))
            for k in range(orders)}


def micro_batches(shard, *, micro_batch_size: int, bucket_batches: int, max_seq_len: int, offline: bool, seed: int):
    """Yield dflash.training.MicroBatch objects from a Ray DataIterator, bucketed by length (see module doc).

    Deterministic for a given shard order and seed: the same data and seed give the same
    micro-batches in both modes.
    """
    rng = random.Random(seed)
    buffer_rows = micro_batch_size * bucket_batches
    for table in shard.iter_batches(batch_size=buffer_rows, batch_format="pyarrow", prefetch_batches=1):
        ids, masks, hidden = table_rows(table, max_seq_len, offline)
        labels = label_rows(table, max_seq_len)
        order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
        groups = [order[i: i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
        rng.shuffle(groups)
        for g in groups:
            yield collate([ids[i] for i in g], [masks[i] for i in g], [hidden[i] for i in g] if offline else None,
                          [labels[i] for i in g] if labels is not None else None)
