"""Teacher-forced training data: the source's own replies, labelled by the target.

Regenerating replies costs one target step per token (~10 reply tokens/s on a CPU core
for long multi-turn answers); one teacher-forced pass over an existing conversation costs
a prefill (~400 tokens/s). The pass gives, at every position, the tapped features the
drafter reads and the target's greedy next token (`target_ids`), which is the label:
a block drafted from anchor a predicts the target's greedy continuation, and slot k of
it is trustworthy only while the source tokens a+1 .. a+k-1 are the target's own
(dflash.masks.block_labels applies that rule at training time). Position 1 of every
block is always supervised; later positions as often as the source agrees with the
target (benchmarks/bench_teacher_forcing.py measured 0.63 for one token, 0.29 for three
in a row, on ShareGPT with the default target).

Worked example (one exchange, ChatML):
    full   = template([u1, a1])               (no generation prompt)
    p1     = template([u1], gen=True)         a1's span starts at len(p1) and runs to the
                                              first stop token after it, inclusive
    loss_mask = 1 on that span; target_ids[t] = argmax of the target's logits at t - 1.

Framework-free: no Ray here. The distill worker (pipelines/distill_worker.py) calls
`source_sequence` and `teacher_forced` with `responses: source`.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash.masks import causal_attention_mask
from dflash.regenerate import chat_prompt_ids, mask_reply, template_kwargs
from dflash.training import round_to_storage


def source_messages(messages: list[dict], max_turns: int) -> list[dict]:
    """A normalised conversation (dflash.data) cut to its first max_turns assistant replies;
    replies before the first user turn and a last, unanswered user turn are dropped.
    Example: [sys, a0, u1, a1, u2, a2], max_turns 1 -> [sys, u1, a1]."""
    out, replies, seen_user = [], 0, False
    for m in messages:
        if m["role"] == "assistant":
            if not seen_user:
                continue
            replies += 1
        elif replies == max_turns:
            break
        seen_user = seen_user or m["role"] == "user"
        out.append(m)
    while out and out[-1]["role"] == "user" and replies:  # an unanswered last turn teaches nothing
        out.pop()
    return out


def source_sequence(tokenizer, messages: list[dict], stop_token_ids, max_seq_len: int,
                    thinking: bool | None = None) -> tuple[list[int], list[int]]:
    """A conversation with its source replies -> (input_ids, loss_mask), cut to max_seq_len.

    Every assistant reply is masked from where the template's generation prompt ends to its
    first stop token (inclusive). A reply whose prompt is not a prefix of the whole
    rendering (templates that rewrite earlier turns) stays unmasked.
    """
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                         **template_kwargs(tokenizer, thinking))
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    stops = set(stop_token_ids)
    mask = [0] * len(full)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = chat_prompt_ids(tokenizer, messages[:i], thinking)
        if full[: len(prompt)] == prompt:
            mask_reply(mask, full, len(prompt), stops)
    return full[:max_seq_len], mask[:max_seq_len]


@torch.no_grad()
def teacher_forced(target, sequence: list[int], layer_ids: tuple[int, ...]) -> tuple[np.ndarray | None, list[int]]:
    """One cache-less target pass over a whole sequence -> (features (n, n_taps*D) float16 as
    stored, or None when layer_ids is empty; target_ids: the target's greedy token at each
    position given the tokens before it, with target_ids[0] = sequence[0])."""
    n = len(sequence)
    ids = torch.tensor([sequence], dtype=torch.long, device=target.device)
    out = target.forward(ids, torch.arange(n, device=target.device)[None],
                         causal_attention_mask(torch.ones(1, n, dtype=torch.bool, device=target.device)),
                         tap_layer_ids=tuple(layer_ids) or None, logits_slice=slice(0, n - 1))
    greedy = out.logits[0].argmax(-1).tolist()  # row t predicts the token at t + 1
    taps = round_to_storage(out.taps[0]).cpu().numpy() if layer_ids else None
    return taps, [sequence[0]] + greedy
