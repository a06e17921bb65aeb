"""Regenerate conversations with the target, and tap its hidden states: the distillation math.

DFlash trains on the target's OWN responses (same chat template, same thinking mode as
will be served), so every assistant turn of a source conversation is rewritten:
turn k is generated from [system?, u1, a1', ..., uk] where a1'.. are the regenerated
turns, rendered by the target's chat template exactly as a server would render them.

Worked example (two turns, ChatML):
    p1 = template([u1], gen=True)            -> generate r1 = a1' tokens + <|im_end|>
    p2 = template([u1, a1', u2], gen=True)   -> generate r2
    input_ids = p2 + r2;  loss_mask = 1 on r2 and on a1's span inside p2, which starts at
    len(p1) (p1 is a prefix of p2 for prefix-stable templates) and runs to the first stop
    token after it, inclusive. A template that is not prefix-stable (e.g. one that strips
    earlier <think> blocks) leaves earlier turns unmasked: only the last turn is scored.

Batched: every turn is one batched generation over the conversations still going.
Sampling is seeded per call from (seed, batch key, turn), so rerunning the same batch
reproduces it token for token; greedy needs no seed. Framework-free: no Ray here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from dflash.sampling import check_sampling_ranges
from dflash.training import right_pad, round_to_storage, target_features


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 128  # per assistant turn
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_turns: int = 2  # assistant turns regenerated per conversation
    max_seq_len: int = 2048  # prompt + all turns; a turn is generated only if it fits whole
    thinking: bool | None = None  # enable_thinking for templates that take it; None = template default

    def __post_init__(self):
        check_sampling_ranges(self.max_new_tokens, self.temperature, self.top_p)  # the one range rule
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_seq_len <= self.max_new_tokens:
            raise ValueError(f"max_seq_len {self.max_seq_len} leaves no room for a prompt of "
                             f"max_new_tokens {self.max_new_tokens}")


def template_kwargs(tokenizer, thinking: bool | None) -> dict:
    """Pass `enable_thinking` only to templates that read it (Qwen3-style)."""
    if thinking is None or "enable_thinking" not in str(tokenizer.chat_template or ""):
        return {}
    return {"enable_thinking": thinking}


def chat_prompt_ids(tokenizer, messages: list[dict], thinking: bool | None = None) -> list[int]:
    """Tokens of `messages` + the assistant generation prompt (needs only a tokenizer, so the
    driver can check prompt budgets without loading the model)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **template_kwargs(tokenizer, thinking))
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def mask_reply(loss_mask: list[int], ids: list[int], start: int, stops: set[int]) -> None:
    """Set loss_mask to 1 on the reply starting at `start`: up to its first stop token,
    inclusive (to the end of ids if none). Example: ids [u, u, a, b, <end>, u], start 2
    -> mask [0, 0, 1, 1, 1, 0]."""
    end = start
    while end < len(ids) and ids[end] not in stops:
        end += 1
    for j in range(start, min(end + 1, len(ids))):
        loss_mask[j] = 1


def _seed(seed: int, key: str, turn: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}:{turn}".encode()).digest()[:8], "little") >> 1


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of row `row` of a batch generated with `seed`."""
    return _seed(seed, "row", row)


@torch.no_grad()
def generate_batch(target, prompts: list[list[int]], params: GenerationParams, seed: int = 0) -> list[list[int]]:
    """One batched generation -> each response cut after its first stop token (kept).

    Runs our own decode loop (SpeculativeDecoder without a drafter): rows leave the batch
    as soon as they stop, where `model.generate` keeps computing them until the longest
    row ends (a 64-sample ShareGPT shard: ~1.5 instead of ~4 core-minutes). top_k, which
    that loop does not take, falls back to transformers' generate.
    """
    if params.top_k:
        return _hf_generate_batch(target, prompts, params, seed)
    from dflash.decoding import SamplingParams, SpeculativeDecoder

    sp = [SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                         top_p=params.top_p, seed=row_seed(seed, i)) for i in range(len(prompts))]
    return [r.output_ids for r in SpeculativeDecoder(target).generate(prompts, sp)]


def _hf_generate_batch(target, prompts: list[list[int]], params: GenerationParams, seed: int) -> list[list[int]]:
    """transformers' left-padded batched generate, for the parameters our loop lacks."""
    from transformers import GenerationConfig

    stops = target.stop_token_ids
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else stops[0]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # (b, L), left padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    gen = GenerationConfig(
        max_new_tokens=params.max_new_tokens, do_sample=True, temperature=params.temperature,
        top_p=params.top_p, top_k=params.top_k, eos_token_id=stops, pad_token_id=pad,
    )
    torch.manual_seed(seed)
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                generation_config=gen)  # (b, L + new)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
        responses.append(row[:cut])
    return responses


def regenerate(
    target, conversations: list[tuple[str | None, list[str]]], params: GenerationParams, seed: int = 0, key: str = "",
    generate=None,
) -> list[tuple[list[int], list[int]]]:
    """(system, user turns) per conversation -> (input_ids, loss_mask) per conversation.

    generate: what writes each turn's responses, generate_batch's signature (default: it;
    pipelines/vllm_generate.VllmGenerator: vLLM).

    Conversations whose first prompt does not fit max_seq_len must be filtered out before
    (the distill driver rejects them); later turns that do not fit are simply not generated.
    """
    tok = target.tokenizer
    history = [([{"role": "system", "content": s}] if s is not None else []) for s, _ in conversations]
    prompt_starts: list[list[int]] = [[] for _ in conversations]  # len(p_k) of each regenerated turn
    last: list[tuple[list[int], list[int]] | None] = [None] * len(conversations)
    going = [True] * len(conversations)
    for turn in range(params.max_turns):
        active, prompts = [], []
        for i, (_, users) in enumerate(conversations):
            if not going[i] or turn >= len(users):
                continue
            p = chat_prompt_ids(tok, history[i] + [{"role": "user", "content": users[turn]}], params.thinking)
            if len(p) + params.max_new_tokens > params.max_seq_len:
                going[i] = False  # over budget: the conversation ends at the previous turn
                continue
            active.append(i)
            prompts.append(p)
        if not active:
            break
        responses = (generate or generate_batch)(target, prompts, params, _seed(seed, key, turn))
        for i, p, r in zip(active, prompts, responses):
            history[i] = history[i] + [{"role": "user", "content": conversations[i][1][turn]},
                                       {"role": "assistant", "content": tok.decode(r, skip_special_tokens=True)}]
            prompt_starts[i].append(len(p))
            last[i] = (p, r)
    stops = set(target.stop_token_ids)
    results = []
    for i, pr in enumerate(last):
        if pr is None:
            raise ValueError(f"conversation {i}: first prompt does not fit max_seq_len {params.max_seq_len}")
        p, r = pr
        input_ids = p + r
        loss_mask = [0] * len(p) + [1] * len(r)
        for start in prompt_starts[i][:-1]:  # earlier turns, found inside the last prompt
            mask_reply(loss_mask, p, start, stops)
        results.append((input_ids, loss_mask))
    return results


def tapped_hidden(target, sequences: list[list[int]], layer_ids: tuple[int, ...]) -> list[np.ndarray]:
    """One right-padded forward over whole sequences -> per sequence (n_i, n_taps*D) features
    as they are stored (dflash.training.round_to_storage: float16, clamped to its range)."""
    ids, valid = right_pad(sequences)  # (b, T)
    taps = round_to_storage(target_features(target, ids, valid, layer_ids)).cpu()  # (b, T, n_taps*D)
    return [taps[i, : len(s)].numpy() for i, s in enumerate(sequences)]
