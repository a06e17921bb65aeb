"""Teacher-forced data (`responses: source`): source replies, the target's greedy tokens as
labels, through distillation (real Ray Data job, real default target) into training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import start_local_ray
from dflash.data import EMPTY, hidden_arrays, read_dataset_metadata
from dflash.decoding import SamplingParams, SpeculativeDecoder
from dflash.teacher_forcing import source_messages, source_sequence, teacher_forced
from pipelines.distill import DistillConfig, run_distill

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Give me a synonym for happy."},
                  {"role": "assistant", "content": "Joyful, of course."},
                  {"role": "user", "content": "And one for sad?"},
                  {"role": "assistant", "content": "Gloomy."}]},
    {"conversations": [{"from": "human", "value": "What is 12 times 12?"}, {"from": "gpt", "value": "It is 144."}]},
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."},
                  {"role": "assistant", "content": "A pear."}]},
    {"prompt": "A prompt without any reply."},  # nothing to teacher-force: rejected
]


def test_source_messages_keep_the_first_replies_after_a_user_turn():
    sys_, u1, a0, a1, u2, a2 = ({"role": r, "content": c} for r, c in [
        ("system", "s"), ("user", "u1"), ("assistant", "a0"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2")])
    assert source_messages([sys_, a0, u1, a1, u2, a2], 1) == [sys_, u1, a1]
    assert source_messages([sys_, a0, u1, a1, u2, a2], 4) == [sys_, u1, a1, u2, a2]
    assert source_messages([u1], 2) == [u1]


def test_mask_covers_each_source_reply(target_fp32):
    tok = target_fp32.tokenizer
    messages = CONVERSATIONS[0]["messages"]
    ids, mask = source_sequence(tok, messages, target_fp32.stop_token_ids, 512)
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    spans += [cur] if cur else []
    assert [tok.decode(s) for s in spans] == ["Joyful, of course.<|im_end|>", "Gloomy.<|im_end|>"]
    cut, cut_mask = source_sequence(tok, messages, target_fp32.stop_token_ids, 20)
    assert cut == ids[:20] and cut_mask == mask[:20]


def test_target_ids_are_the_targets_greedy_tokens(target_fp32):
    """Teacher-forcing the target's own greedy reply gives back that reply as its labels,
    and every label is the argmax of a separate forward over the prefix before it."""
    prompt = target_fp32.chat_ids([{"role": "user", "content": "Count from one to five."}])
    reply = SpeculativeDecoder(target_fp32).generate([prompt], [SamplingParams(max_new_tokens=12)])[0].output_ids
    seq = prompt + reply
    taps, target_ids = teacher_forced(target_fp32, seq, (1, 27))
    assert len(target_ids) == len(seq) and target_ids[0] == seq[0] and taps.shape == (len(seq), 2 * 576)
    assert target_ids[len(prompt):] == reply
    for t in (1, len(prompt) // 2, len(seq) - 1):
        logits = target_fp32.model(torch.tensor([seq[:t]])).logits[0, -1]
        assert int(logits.argmax()) == target_ids[t]
    none, again = teacher_forced(target_fp32, seq, ())
    assert none is None and again == target_ids


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="unknown responses"):
        DistillConfig(responses="copied")
    with pytest.raises(ValueError, match="temperature 0"):
        DistillConfig(responses="source", temperature=1.0)


def test_reference_configs_load_and_chain():
    """distill_tf.yaml writes teacher-forced data where train_v2.yaml reads it."""
    from dflash.config_file import load_config
    from pipelines.train import TrainConfig

    repo = Path(__file__).resolve().parents[1] / "jobs/configs/reference"
    data = load_config(DistillConfig, repo / "distill_tf.yaml")
    train = load_config(TrainConfig, repo / "train_v2.yaml")
    assert data.responses == "source" and data.temperature == 0 and data.features == "taps"
    assert train.data == data.output_dir and train.offline and train.checkpoint_every <= 1000


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    start_local_ray()
    src = tmp_path_factory.mktemp("src") / "chats.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = tmp_path_factory.mktemp("forced") / "out"
    cfg = DistillConfig(source=str(src), split="all", limit=0, responses="source", max_turns=4, max_new_tokens=16,
                        max_seq_len=512, num_taps=2, shard_size=2, dtype="fp32", output_dir=str(out), progress=False)
    return out, run_distill(cfg)


def test_distill_writes_labels_beside_the_source_replies(forced, target_fp32):
    out, summary = forced
    assert summary["samples"] == 3 and summary["rejects"] == {EMPTY: 1}
    meta = read_dataset_metadata(out)
    assert meta.responses == "source" and summary["metadata"]["responses"] == "source"
    table = pq.read_table(out)
    hidden = hidden_arrays(table)
    for i, row in enumerate(table.select(["input_ids", "loss_mask", "target_ids"]).to_pylist()):
        assert len(row["target_ids"]) == len(row["input_ids"]) == len(row["loss_mask"])
        taps, labels = teacher_forced(target_fp32, row["input_ids"], meta.target_layer_ids)
        assert row["target_ids"] == labels
        np.testing.assert_array_equal(hidden[i], taps)
        replies = target_fp32.tokenizer.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
        assert "Gloomy." in replies or "144" in replies or "pear" in replies


def test_training_reads_the_labels_and_scores_only_the_targets_path(forced, target_fp32):
    """Ray Data -> micro_batches carries target_ids; the loss then scores slot k only where
    the k-1 source tokens before it agree with the target (fewer slots than source labels)."""
    from dflash.config import DrafterConfig
    from dflash.objective import dflash_loss
    from dflash.training import new_drafter
    from pipelines.train_data import inspect_training_data, micro_batches, read_dataset

    out, _ = forced
    t = target_fp32
    meta = read_dataset_metadata(out)
    info = inspect_training_data(str(out), offline=True, target_id=meta.target_id, weights_hash=meta.weights_hash,
                                 num_target_layers=t.num_layers, hidden_size=t.hidden_size,
                                 target_layer_ids=meta.target_layer_ids)
    shard = read_dataset(info, offline=True).iterator()
    batches = list(micro_batches(shard, micro_batch_size=4, bucket_batches=1, max_seq_len=512, offline=True, seed=0))
    mb = batches[0]
    assert mb.target_ids is not None and mb.target_ids.shape == mb.input_ids.shape
    torch.manual_seed(0)
    drafter = new_drafter(DrafterConfig.for_target(t, 1, 4, list(meta.target_layer_ids)), t)
    every = (mb.loss_mask & mb.valid).nonzero()
    anchors = (every[:, 1].view(1, -1), torch.ones(1, every.shape[0], dtype=torch.bool))
    rows = every[:, 0] == 0  # one row's response positions as anchors
    anchors = (anchors[0][:, rows], anchors[1][:, rows])
    args = (drafter, t.embed, t.lm_head, mb.input_ids[:1], mb.loss_mask[:1], mb.taps[:1].float(), mb.valid[:1])
    plain = dflash_loss(*args, anchors=anchors)
    labelled = dflash_loss(*args, anchors=anchors, target_ids=mb.target_ids[:1])
    assert labelled.counts[0] == plain.counts[0]  # slot 1 is always on the target's path
    agree = (mb.input_ids[0] == mb.target_ids[0]) & mb.valid[0]
    assert bool((~agree[mb.loss_mask[0]]).any())  # the source leaves the target's path somewhere ...
    assert labelled.counts[1:].sum() < plain.counts[1:].sum()  # ... so later slots are scored less


def test_ray_train_with_deepspeed_trains_on_teacher_forced_data(forced, tmp_path):
    """`dflash train` end to end on the teacher-forced shards: the labels column travels
    through Ray Data into the DeepSpeed engine's forward, and a drafter is exported."""
    from dflash.checkpoint import read_drafter_config
    from pipelines.train import TrainConfig, run_train

    out, _ = forced
    meta = read_dataset_metadata(out)
    cfg = TrainConfig(data=str(out), output_dir=str(tmp_path / "runs"), target_layer_ids=meta.target_layer_ids,
                      num_anchors=8, block_size=8, micro_batch_size=2, checkpoint_every=2, bucket_batches=2,
                      lr=1e-3, warmup_ratio=0.0, max_steps=3)
    summary = run_train(cfg)
    assert summary["steps"] == 3 and summary["first_loss"] > 0 and summary["final_accuracy"] is not None
    assert list(read_drafter_config(summary["drafter_dir"]).target_layer_ids) == list(meta.target_layer_ids)
