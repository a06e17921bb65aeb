"""Small helpers shared by tests: target-generated sequences and a briefly trained drafter."""

from __future__ import annotations

import torch

from dflash.config import DrafterConfig
from dflash.decoding import SamplingParams, SpeculativeDecoder
from dflash.drafter import DFlashDrafter
from dflash.objective import dflash_loss, implied_tau
from dflash.target import Target
from dflash.training import target_features

GREEDY_TOKENS = 32  # new tokens of the greedy reference outputs (the `reference` fixture)

CHAT_PROMPTS = [
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Explain gravity in one sentence.",
    "Give me a Python function that reverses a string.",
    "What is the capital of France?",
    "List four animals that live in the ocean.",
    "How do I boil an egg?",
]


def chat_prompt_ids(target: Target, questions=CHAT_PROMPTS) -> list[list[int]]:
    return [target.chat_ids([{"role": "user", "content": q}]) for q in questions]


def hf_greedy(target: Target, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate, one prompt at a time: the reference output."""
    out = target.model.generate(torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=target.stop_token_ids, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def padded_batch(prompts: list[list[int]], outputs: list[list[int]]):
    """Right-padded (ids, loss_mask, valid) tensors of prompt+output sequences."""
    seqs = [p + o for p, o in zip(prompts, outputs)]
    t = max(map(len, seqs))
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    valid = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        loss_mask[i, len(p): len(s)] = True
        valid[i, : len(s)] = True
    return ids, loss_mask, valid


# the trainer's features of a padded batch (raw, not rounded), under the name test_draft_vocab uses
target_taps = target_features


def train_memorising_drafter(target: Target, prompts: list[list[int]], max_new_tokens=40, block_size=8,
                             steps=120, lr=3e-3, num_anchors=16, seed=0):
    """Train a 1-layer drafter on the target's own greedy continuations of `prompts`.

    Returns (drafter, history) where history holds per-step loss and per-position accuracy.
    """
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target, num_taps=3,
                                   block_size=block_size)
    drafter = DFlashDrafter(cfg)
    outputs = [r.output_ids for r in SpeculativeDecoder(target).generate(prompts, SamplingParams(max_new_tokens))]
    ids, loss_mask, valid = padded_batch(prompts, outputs)
    taps = target_features(target, ids, valid, cfg.target_layer_ids)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    history = []
    drafter.train()
    for _ in range(steps):
        out = dflash_loss(drafter, target.embed, target.lm_head, ids, loss_mask, taps, valid,
                          num_anchors=num_anchors, generator=g)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        history.append({"loss": out.loss.item(), "acc": out.accuracy.tolist(), "tau": implied_tau(out.accuracy)})
    drafter.eval()
    return drafter, history, outputs
