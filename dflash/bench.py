"""Benchmark: autoregressive vs DFlash decoding of the same target, side by side.

Both run in the same process, on the same prompts, one prompt at a time (latency, the
regime speculative decoding is for), after a warm-up; transformers' prompt-lookup decoding
(n-gram drafts copied from the prompt) can run beside them as a peer baseline, and with
context lookup on, DFlash without it as the ablation. Reported per run: tau, acceptance
histogram and acceptance by draft position (overall, and per guess source), tokens/s of
each, speedup, the cycle cost in AR steps, the exact-match rate against AR, the verify widths
chosen (adaptive width, dflash.width) with the measured cost curve behind them (a width-W
verify in one-token steps, batch 1), the CPU it ran on, and `lossless`:
  fp32 greedy  every DFlash output equals the AR output token for token;
  bf16 greedy  every emitted token is the target's argmax given the emitted prefix, up to
               `margin` logits, re-scored with one teacher-forced pass (a multi-token verify
               rounds differently from one-token steps, so near-ties may flip);
  T > 0        not checkable per sample (see tests/test_sampling.py for the distribution test).
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash.decoding import SpeculativeDecoder
from dflash.masks import causal_attention_mask
from dflash.sampling import SamplingParams
from dflash.target import Target

BF16_MARGIN = 0.5


@torch.no_grad()
def emitted_token_margins(target: Target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """(len(output),) max logit minus the emitted token's logit, teacher-forced in one pass.
    0 everywhere means every token was the target's argmax."""
    if not output:
        return torch.zeros(0)
    ids = torch.tensor([prompt + output], device=target.device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(ids.shape[1], device=target.device)[None]
    rows = target.forward(ids, pos, causal_attention_mask(valid)).logits[0, len(prompt) - 1: -1].float()
    chosen = rows.gather(1, torch.tensor(output, device=rows.device)[:, None]).squeeze(1)
    return (rows.max(1).values - chosen).cpu()


def acceptance_by_position(histogram: list[int]) -> list[float | None]:
    """histogram[k] = cycles that emitted k + 1 tokens (k drafts accepted, plus the bonus)
    -> for draft position k = 1..len-1, P(accepted | every draft before it was accepted),
    None where no cycle reached it. tau = 1 + p1 + p1*p2 + ..., so this says which
    position a drafter loses its tokens at."""
    rates: list[float | None] = []
    for k in range(1, len(histogram)):
        reached = sum(histogram[k - 1:])  # cycles whose drafts 1..k-1 were all accepted
        rates.append(sum(histogram[k:]) / reached if reached else None)
    return rates


def cpu_description(cpuinfo: str | None = None) -> dict:
    """The CPU's model name (what lscpu prints) and whether it computes bf16 natively."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags |= set(value.split())
    return {"model": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "avx512f": "avx512f" in flags}


def measured_rates(tried: list[int], accepted: list[int]) -> list[float | None]:
    """Per draft position: accepted / tried (None where never tried)."""
    return [round(a / t, 4) if t else None for t, a in zip(tried, accepted)]


def _prompt_lookup(target: Target, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> tuple[list[int], float]:
    """transformers' prompt-lookup decoding (n-gram drafts from the prompt): a peer baseline.
    At T > 0 transformers samples from the target and keeps the drafts that match."""
    sampling = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = target.model.generate(torch.tensor([prompt], device=target.device), max_new_tokens=max_new_tokens,
                                prompt_lookup_num_tokens=10, eos_token_id=target.stop_token_ids,
                                pad_token_id=target.stop_token_ids[0] if target.stop_token_ids else 0, **sampling)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def _cost_curve(decoder: SpeculativeDecoder) -> list[float] | None:
    """verify(1, W) / verify(1, 1) for W = 1 .. max_width from the decoder's cost model."""
    if decoder.policy is None:
        return None
    curve = decoder.policy.costs.curve(1, range(1, decoder.max_width + 1))
    return [curve[w] for w in sorted(curve)] if curve else None


def fp32_exact_check(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new_tokens: int) -> bool:
    """Greedy output of `decoder` == greedy AR output, token for token (meaningful in fp32 only)."""
    target = decoder.target
    if target.dtype != torch.float32:
        raise ValueError("the token-for-token check needs an fp32 target (bf16 verify rounds differently)")
    params = SamplingParams(max_new_tokens)
    ar = SpeculativeDecoder(target).generate(prompts, params, batch_size=1)
    spec = decoder.generate(prompts, params, batch_size=1)
    return all(a.output_ids == d.output_ids for a, d in zip(ar, spec))


def run_bench(
    decoder: SpeculativeDecoder,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    prompt_lookup: bool = False,
    margin: float = BF16_MARGIN,
    progress=None,
    drafter_only: bool = False,
) -> dict:
    """AR vs `decoder` (a DFlash decoder, e.g. dflash.pair.load_pair's) on `prompts` (token
    ids). Returns a JSON-ready summary dict. AR is the same target through the same loop
    with no drafter; drafter_only also times the drafter without context or corpus lookup
    (the ablation, `drafter_only_*` fields)."""
    target, drafter, spec = decoder.target, decoder.drafter, decoder
    ar = SpeculativeDecoder(target)
    alone = (SpeculativeDecoder(target, drafter, verify=spec.verify, block_size=spec.block_size,
                                adaptive=spec.policy is not None)
             if drafter_only and (spec.lookup or spec.corpus) else None)
    lookup, corpus, tree = spec.lookup, spec.corpus, spec.tree
    B = spec.block_size
    params = [SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i) for i in range(len(prompts))]
    # warm-up (allocator, kernels): not timed
    ar.generate([prompts[0]], SamplingParams(4))
    spec.generate([prompts[0]], SamplingParams(4))
    if alone:
        alone.generate([prompts[0]], SamplingParams(4))
    if prompt_lookup:
        _prompt_lookup(target, prompts[0], 4)

    ar_tokens = spec_tokens = pl_tokens = 0
    ar_time = spec_time = pl_time = draft_time = verify_time = 0.0
    hist = [0] * spec.max_width
    accept_lengths: list[int] = []
    widths = [0] * spec.max_width  # widths[W-1] = cycles that verified W tokens
    tried: dict[str, list[int]] = {}
    accepted: dict[str, list[int]] = {}
    lookup_cycles = corpus_cycles = alone_tokens = 0
    alone_time = 0.0
    alone_lengths: list[int] = []
    exact = 0
    worst_margin = 0.0
    pl_exact = 0
    per_prompt = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        a = ar.generate([p], [sp])[0]
        d = spec.generate([p], [sp])[0]
        ar_tokens += len(a.output_ids)
        ar_time += a.stats.total_time_s
        spec_tokens += len(d.output_ids)
        spec_time += d.stats.total_time_s
        draft_time += d.stats.draft_time_s
        verify_time += d.stats.verify_time_s
        accept_lengths += d.stats.acceptance_lengths
        lookup_cycles += d.stats.lookup_cycles
        corpus_cycles += d.stats.corpus_cycles
        for k, c in enumerate(d.stats.histogram()):
            hist[k] += c
        for w in d.stats.verify_widths:
            widths[min(w, spec.max_width) - 1] += 1
        for src, counts in d.stats.tried.items():
            tried[src] = [a + b for a, b in zip(tried.get(src, [0] * len(counts)), counts)]
            accepted[src] = [a + b for a, b in zip(accepted.get(src, [0] * len(counts)), d.stats.accepted[src])]
        same = a.output_ids == d.output_ids
        exact += same
        if temperature == 0 and not same:
            worst_margin = max(worst_margin, float(emitted_token_margins(target, p, d.output_ids).max()))
        row = {"prompt_tokens": len(p), "ar_tokens": len(a.output_ids), "dflash_tokens": len(d.output_ids),
               "tau": round(d.stats.tau, 3), "exact_match": same}
        if alone:
            o = alone.generate([p], [sp])[0]
            alone_tokens += len(o.output_ids)
            alone_time += o.stats.total_time_s
            alone_lengths += o.stats.acceptance_lengths
            row["drafter_only_tau"] = round(o.stats.tau, 3)
        if prompt_lookup:
            out, dt = _prompt_lookup(target, p, max_new_tokens, temperature, top_p, sp.seed)
            pl_tokens += len(out)
            pl_time += dt
            pl_exact += out == a.output_ids
        per_prompt.append(row)
        if progress:
            progress(i + 1, len(prompts), row)

    fp32 = target.dtype == torch.float32
    if temperature > 0:
        lossless = None
    elif fp32:
        lossless = exact == len(prompts)
    else:
        lossless = worst_margin <= margin
    ar_tps = ar_tokens / ar_time if ar_time else 0.0
    spec_tps = spec_tokens / spec_time if spec_time else 0.0
    tau = sum(accept_lengths) / len(accept_lengths) if accept_lengths else 0.0
    result = {
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "dtype": str(target.dtype).replace("torch.", ""),
        "device": str(target.device),
        "block_size": B,
        "tree_nodes": tree.max_nodes if tree else None,
        "lookup": asdict(lookup) if lookup else None,
        "lookup_cycle_fraction": round(lookup_cycles / len(accept_lengths), 4) if accept_lengths else 0.0,
        "corpus": {"tokens": int(len(corpus.tokens)), "entries": corpus.num_entries} if corpus else None,
        "corpus_cycle_fraction": round(corpus_cycles / len(accept_lengths), 4) if accept_lengths else 0.0,
        "tau": round(tau, 4),
        "acceptance_histogram": hist,
        "acceptance_by_position": [None if p is None else round(p, 4) for p in acceptance_by_position(hist)],
        # per guess source: accepted / scored at each draft position, over the guesses verified
        "acceptance_by_source": {src: measured_rates(tried[src], accepted[src]) for src in sorted(tried)},
        "width": "adaptive" if spec.policy is not None else "pinned",
        "verify_width_histogram": widths,  # [W-1] = cycles that verified W tokens
        "mean_verify_width": round(sum((w + 1) * c for w, c in enumerate(widths)) / max(1, sum(widths)), 3),
        # a width-W verify's measured cost in one-token steps at batch 1 (index W-1)
        "verify_cost_curve": _cost_curve(spec),
        "cpu": cpu_description() if str(target.device) == "cpu" else None,
        "ar_tokens_per_s": round(ar_tps, 3),
        "dflash_tokens_per_s": round(spec_tps, 3),
        "speedup": round(spec_tps / ar_tps, 4) if ar_tps else 0.0,
        # one DFlash cycle's time in AR steps (= tau / speedup): 2x needs tau = 2 x this
        "cycle_cost_ar_steps": round(tau * ar_tps / spec_tps, 4) if spec_tps else 0.0,
        "exact_match_rate": round(exact / len(prompts), 4),
        "lossless": lossless,
        "lossless_rule": None if temperature > 0 else ("exact" if fp32 else f"argmax within {margin} logits"),
        "worst_argmax_margin": round(worst_margin, 4),
        "draft_time_per_cycle_ms": round(1000 * draft_time / max(1, len(accept_lengths)), 3),
        "verify_time_per_cycle_ms": round(1000 * verify_time / max(1, len(accept_lengths)), 3),
        "per_prompt": per_prompt,
    }
    if alone:
        result["drafter_only_tau"] = round(sum(alone_lengths) / len(alone_lengths), 4) if alone_lengths else 0.0
        result["drafter_only_tokens_per_s"] = round(alone_tokens / alone_time, 3) if alone_time else 0.0
        result["drafter_only_speedup"] = round((alone_tokens / alone_time) / ar_tps, 4) if alone_time and ar_tps else 0.0
    if prompt_lookup:
        result["prompt_lookup_tokens_per_s"] = round(pl_tokens / pl_time, 3) if pl_time else 0.0
        result["prompt_lookup_speedup"] = round((pl_tokens / pl_time) / ar_tps, 4) if pl_time and ar_tps else 0.0
        result["prompt_lookup_exact_match_rate"] = round(pl_exact / len(prompts), 4) if temperature == 0 else None
    return result
