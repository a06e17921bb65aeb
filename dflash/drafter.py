"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass.

Each layer attends over [context keys/values ; block keys/values]. The context part is the
"KV injection": the target's tapped hidden states, fused once (fc + RMSNorm), go through
THIS layer's k_proj/v_proj (+ k_norm, + RoPE at their absolute positions) and are prepended
to the block's keys/values. Context features never enter Q, O, the MLP or the residual
stream. The drafter owns no embedding and no LM head: callers embed with the target's
embedding and score with the target's LM head (both frozen).

The same `forward` serves training (many blocks per sequence, a block mask from
`dflash.masks`) and inference (one block per sequence, a cached context), which is what
makes the train/inference parity test meaningful.

Shapes: b batch, q block queries, c context slots, D hidden, H/Hkv heads, d head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Standard (non-interleaved, rotate-half) RoPE, as in Llama/Qwen3.

    Frequencies are computed in fp32 on every call (no buffer), so casting the drafter to
    bf16 never rounds them.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (b, t) -> cos, sin (b, 1, t, d) ready to broadcast over heads
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=positions.device) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        freqs = positions.float()[..., None] * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, t, D) -> k, v (b, Hkv, t, d); k normed and rotated at its positions."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """h (b, q, D) block stream; ctx_k/ctx_v (b, Hkv, c, d); mask (b, 1, q, c+q) bool."""
        b, q, _ = h.shape
        query = self.q_norm(self.q_proj(h).view(b, q, self.n_heads, self.head_dim)).transpose(1, 2)
        query = apply_rope(query, cos, sin)
        k_blk, v_blk = self.key_value(h, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q, self.n_heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, h, cos, sin, ctx_k, ctx_v, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v (b, Hkv, c, d)


class DFlashDrafter(nn.Module):
    """fc + hidden_norm fuse the target taps; `layers` denoise the block; `norm` before the LM head."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        if cfg.draft_vocab_size:  # target token ids the drafter may draft, sorted (set by training)
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab = None
        # (D,) the embedding of the mask slots when a checkpoint ships its own (mask_embedding.pt),
        # else None and mask slots embed as the target's row mask_token_id. Not in the state dict:
        # dflash.checkpoint reads and writes it as its own file, the way vLLM does
        self.register_buffer("mask_embedding", None, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, zero_output: bool = False):
        """Normal(0, std) linears, unit norms. zero_output: o_proj and down_proj start at 0,
        so every layer starts as the identity and the first predictions are those of the
        block's own embeddings (a far lower first loss than random outputs through a tied head)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
        if zero_output:
            for layer in self.layers:
                nn.init.zeros_(layer.self_attn.o_proj.weight)
                nn.init.zeros_(layer.mlp.down_proj.weight)

    @torch.no_grad()
    def set_draft_vocab(self, token_ids: list[int] | torch.Tensor) -> None:
        """The target tokens this drafter may draft (draft_vocab_size of them, any order)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).sort().values
        if self.draft_vocab is None or ids.shape != self.draft_vocab.shape:
            raise ValueError(f"expected {self.config.draft_vocab_size} token ids, got {tuple(ids.shape)}")
        if ids.unique().numel() != ids.numel() or not 0 <= int(ids[0]) <= int(ids[-1]) < self.config.vocab_size:
            raise ValueError("draft vocabulary ids must be distinct target token ids")
        self.draft_vocab.copy_(ids)

    @torch.no_grad()
    def set_mask_embedding(self, embedding: torch.Tensor | None) -> None:
        """Use `embedding` (D,) for the mask slots instead of the target's row (None: the row)."""
        if embedding is not None:
            embedding = embedding.detach().reshape(-1)
            if embedding.shape != (self.config.hidden_size,):
                raise ValueError(f"mask embedding must have {self.config.hidden_size} values, got {embedding.numel()}")
            embedding = embedding.to(self.fc.weight)
        self.mask_embedding = embedding

    def embed_block(self, embed, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids (b, q) -> (b, q, D) block input: `embed` (the target's embedding) of every
        slot, with the drafter's own mask embedding on the mask slots when it has one."""
        emb = embed(block_ids)
        if self.mask_embedding is None:
            return emb
        is_mask = (block_ids == self.config.mask_token_id).unsqueeze(-1)
        return torch.where(is_mask, self.mask_embedding.to(emb.dtype), emb)

    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """taps (b, c, n_taps*D) raw target features -> per-layer injected k, v.

        Callers zero the taps of padding slots first (they are masked, but NaN*0 is NaN).
        """
        fused = self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))
        cos, sin = self.rotary(positions, fused.dtype)
        return [layer.self_attn.key_value(fused, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: ContextKV,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """block_embeds (b, q, D), block_positions (b, q), context from `context_kv`,
        mask (b, 1, q, c+q) bool (True = may attend) -> final hidden (b, q, D), normed."""
        h = block_embeds.to(self.fc.weight.dtype)
        cos, sin = self.rotary(block_positions, h.dtype)
        for layer, (ctx_k, ctx_v) in zip(self.layers, context):
            h = layer(h, cos, sin, ctx_k, ctx_v, mask)
        return self.norm(h)


class OutputHead:
    """The target's frozen LM head, restricted to the drafter's draft vocabulary if it has one.

    logits(hidden) -> (..., K) scores over the K draftable tokens (K = V without a draft
    vocabulary); full(logits) -> (..., V) with -inf on tokens the drafter never drafts, so
    sampling and verification code sees ordinary target-vocabulary distributions;
    index(labels) -> the labels' columns in `logits`, -1 for tokens outside the vocabulary;
    token_ids(columns) -> back to target token ids.
    """

    def __init__(self, lm_head_weight: torch.Tensor, draft_vocab: torch.Tensor | None):
        self.vocab_size = lm_head_weight.shape[0]
        self.vocab = draft_vocab.to(lm_head_weight.device) if draft_vocab is not None else None
        self.weight = lm_head_weight if self.vocab is None else lm_head_weight.index_select(0, self.vocab)
        self._column = None
        if self.vocab is not None:
            self._column = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.vocab.device)
            self._column[self.vocab] = torch.arange(self.vocab.numel(), device=self.vocab.device)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # as a 2D product: a sliced 3D input (b=1, strided) sends CPU bf16 linear down a bmm
        # path that copies the whole (V, D) weight per call, ~20x slower
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.weight.dtype)
        return F.linear(flat, self.weight).float().view(*hidden.shape[:-1], self.weight.shape[0])

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab, logits)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Columns of `logits` -> target token ids (the inverse of `index`)."""
        return columns if self.vocab is None else self.vocab[columns]

    def index(self, labels: torch.Tensor) -> torch.Tensor:
        return labels if self._column is None else self._column[labels]


def concat_context(a: ContextKV | None, b: ContextKV) -> ContextKV:
    """Append context slots (dim 2) layer by layer."""
    if a is None:
        return b
    return [(torch.cat([ka, kb], 2), torch.cat([va, vb], 2)) for (ka, va), (kb, vb) in zip(a, b)]

