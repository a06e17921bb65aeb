"""Pure functions for sampling and lossless verification of a drafted block.

Greedy decoding is the temperature-0 limit of everything here: `token_probs` returns a
one-hot distribution at the argmax, so both verification rules reduce to "accept while the
draft equals the target's argmax, then emit the target's argmax" and one code path serves
greedy and sampled requests in the same batch. The decoder takes the short way where it
can: a cycle with no sampled row under the rejection rule is the match rule on argmaxes
(`target_tokens`), with no (b, k, V) distributions built at all.

Verification rules (DESIGN.md section 1), for draft tokens d_1..d_k and target
distributions p_1..p_{k+1} (p_i is the target's distribution for the token at draft slot i):
  "match"     draft greedily; the target samples y_i ~ p_i; accept d_i while d_i == y_i;
              the bonus token is y at the first mismatch (or y_{k+1}). Lossless because the
              emitted tokens are exactly the target's own samples.
  "rejection" draft d_i ~ q_i; accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at
              the first rejection emit a sample of norm(max(p_i - q_i, 0)); if all accepted
              emit a sample of p_{k+1}. Lossless because q_i depends only on the context
              (single-step block denoising), the classic speculative-sampling argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VERIFY_RULES = ("match", "rejection")

# --- parameter ranges: the one rule that SamplingParams, the CLI, YAML configs and the HTTP
# API all check with `check_sampling_ranges` (an API may narrow a range where its spec does)
MAX_TEMPERATURE = 100.0  # temperature in [0, MAX_TEMPERATURE]; 0 = greedy
OPENAI_MAX_TEMPERATURE = 2.0  # the OpenAI API's temperature range is [0, 2]
# top_p in (0, 1] (the smallest set of tokens whose mass reaches top_p); max_new_tokens >= 1


def check_sampling_ranges(max_new_tokens: int | None = None, temperature: float | None = None,
                          top_p: float | None = None, *, max_temperature: float = MAX_TEMPERATURE) -> None:
    """Raise ValueError naming the first parameter outside its range; None skips a parameter.
    max_temperature narrows the temperature range for an API (e.g. OPENAI_MAX_TEMPERATURE)."""
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature is not None and not 0.0 <= temperature <= max_temperature:
        raise ValueError(f"temperature must be in [0, {max_temperature:g}], got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 = greedy. A seed fixes the request's
    random stream whatever batch it shares (dflash.batch.Request.uniforms). ignore_eos: the
    target's own stop tokens do not end the request (only max_new_tokens and its own
    stop_token_ids do), as vLLM's option of that name: fixed-length benchmarks and tests."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        check_sampling_ranges(self.max_new_tokens, self.temperature, self.top_p)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> the argmax (...), the first maximum like torch.argmax (tested).

    max(-1).indices because it is several times faster than argmax over a vocabulary on CPU
    (49K bf16 logits: 36 vs 161 us a row, 2 threads), which a wide verify pays per slot."""
    return logits.max(-1).indices


def token_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits (b, ..., V); temperature, top_p (b,) -> probabilities (b, ..., V), float32.

    Rows with temperature 0 get a one-hot at the argmax. top_p keeps the smallest set of
    tokens whose mass reaches top_p (the top token always survives).
    """
    logits = logits.float()
    shape = (-1,) + (1,) * (logits.dim() - 1)
    t = temperature.to(logits.device, torch.float32).view(shape)
    greedy = t <= 0
    probs = torch.softmax(logits / torch.where(greedy, torch.ones_like(t), t), dim=-1)
    p = top_p.to(logits.device, torch.float32).view(shape)
    if bool((p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = mass_before < p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    onehot = torch.zeros_like(probs).scatter(-1, greedy_tokens(logits)[..., None], 1.0)
    return torch.where(greedy, onehot, probs)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with caller-supplied uniforms: probs (..., V), u (...) in [0, 1).

    Taking the uniforms as input makes every draw reproducible per request (each request
    owns a torch.Generator) whatever batch it shares, and one-hot rows return their argmax.
    """
    cdf = probs.cumsum(-1)
    target = (u.to(cdf.device, cdf.dtype) * cdf[..., -1])[..., None]
    idx = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True)
    return idx.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def row_uniforms(generators: list[torch.Generator], counts: list[int], width: int) -> torch.Tensor:
    """(b, width) uniforms in [0, 1): row i's first counts[i] drawn from generators[i] (its
    request's own stream), the rest 0. A row draws what it consumes, counts set by its own
    draft alone, so a seeded request's stream is the same whatever rows share its batch.

    Example: counts [2, 0, 3], width 3 -> [[g0, g0, 0], [0, 0, 0], [g2, g2, g2]], where
    g0 are generator 0's next two draws and g2 generator 2's next three.
    """
    u = torch.zeros(len(generators), width)
    for i, (g, n) in enumerate(zip(generators, counts)):
        if n:
            u[i, :n] = torch.rand(n, generator=g)
    return u


def target_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The target's own token at every slot: logits (b, k, V), u (b, k) -> (b, k).

    The same draws as sample_from(token_probs(...), u), but greedy rows take the argmax
    without building (k, V) distributions: over a wide draft tree those cost more than
    the LM head that made the logits."""
    y = greedy_tokens(logits)
    sampled = (temperature > 0).nonzero().flatten().to(logits.device)
    if len(sampled):
        y[sampled] = sample_from(token_probs(logits[sampled], temperature[sampled], top_p[sampled]), u[sampled])
    return y


def accepted_prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """accept (b, k) bool -> number of leading Trues (b,). [T, T, F, T] -> 2."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _within(draft: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor | bool:
    """(b, k) True on each row's own drafts: the first lengths[i] of row i (all without lengths)."""
    if lengths is None:
        return True
    return torch.arange(draft.shape[1], device=draft.device)[None] < lengths.to(draft.device)[:, None]


def verify_match(draft: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (b, k); y (b, k+1) the target's own tokens (target_tokens) -> (num_accepted (b,), bonus (b,)).

    lengths (b,): row i proposed only its first lengths[i] drafts (a batch pads shorter
    drafts to its widest); nothing past them is accepted, so a row's outcome is the one it
    would have alone. The rejection rule on a greedy row (one-hot p and q) is this rule on
    its argmax."""
    n = accepted_prefix_length((draft == y[:, :-1]) & _within(draft, lengths))
    return n, y.gather(1, n[:, None]).squeeze(1)


def verify_rejection(
    draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, u_accept: torch.Tensor, u_bonus: torch.Tensor,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """draft (b, k) sampled from q (b, k, V); p (b, k+1, V); u_accept (b, k); u_bonus (b,).

    -> (num_accepted (b,), bonus (b,)). lengths (b,): as in verify_match; a row that accepts
    all its lengths[i] drafts draws its bonus from p there, whatever q holds past them.
    """
    b, k = draft.shape
    p_d = p[:, :k].gather(-1, draft[..., None]).squeeze(-1)
    q_d = q.gather(-1, draft[..., None]).squeeze(-1)
    accept = (u_accept * q_d < p_d) & _within(draft, lengths)  # u < p/q without dividing by a zero q
    n = accepted_prefix_length(accept)
    # distribution of the bonus token: residual at the first rejection, else p at the row's end
    rows = torch.arange(b, device=draft.device)
    p_n = p[rows, n]
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # q_{k+1} = 0 -> residual = p
    q_n = q_pad[rows, n]
    if lengths is not None:  # past a row's own drafts it proposed nothing: q = 0 there
        q_n = torch.where((n < lengths.to(n.device))[:, None], q_n, torch.zeros_like(q_n))
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)  # p == q exactly: any draw of p
    return n, sample_from(residual, u_bonus)
