"""Transformer blocks the tensor-parallel tests split (tests/test_tensor_parallel.py, tests/test_sequence_parallel.py):
each kind of attention and MLP the default plan knows, and one it must leave whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP: the default plan splits fc1 column-wise and fc2 row-wise."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D`` (transformers.pytorch_utils), as GPT-2 uses it: a Linear with its weight (in, out)."""

    def __init__(self, nf: int, nx: int, scale: float = 0.3) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * scale)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class NanoBlock(nn.Module):
    """A nanoGPT-style block, attention and MLP Linear layers side by side (``qkv``, ``proj``, ``fc1``, ``fc2``),
    reading its widths from its attributes: the default plan splits attention by heads and the MLP."""

    def __init__(self, width: int, n_head: int = 2) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, width
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, L, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT2Attention(nn.Module):
    """Hugging Face GPT-2's attention: a fused ``c_attn`` and ``c_proj`` as Conv1D, ``split_size``, ``num_heads``,
    ``head_dim`` attributes; it returns (output, weights)."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.embed_dim = self.split_size = width
        self.num_heads, self.head_dim = heads, width // heads
        self.c_attn, self.c_proj = Conv1D(3 * width, width), Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (t.view(*t.shape[:-1], -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.c_proj(y.reshape(*y.shape[:-2], -1)), None


class GPT2MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * width, width), Conv1D(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPT2Block(nn.Module):
    """Hugging Face GPT-2's block: LayerNorms, the attention (fused qkv, Conv1D) and the MLP as modules."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = GPT2Attention(width), GPT2MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))[0]
        return x + self.mlp(self.ln2(x))


class GQABlock(nn.Module):
    """Separate q, k, v and o, 4 query heads over 2 key/value heads (grouped-query attention)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = 4, 2, width // 4
        self.q, self.k, self.v = (nn.Linear(width, n * width // 4) for n in (4, 2, 2))
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (t(x).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2) for t in (self.k, self.v))
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)
        return x + self.o(y)


class CausalSelfAttention(nn.Module):
    """nanoGPT's own attention (its layers as GPT-2's Conv1D): it reads its widths from its input (``C //
    self.n_head``, ``view(B, T, C)``), so a shard's heads cannot run it; the default plan tries, and puts it back."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = 2, width
        self.c_attn, self.c_proj = Conv1D(3 * width, width), Conv1D(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        return x + self.c_proj(y)


class LlamaAttention(nn.Module):
    """Separate q, k, v and o, grouped keys and values, widths read from its attributes, called by keyword; it
    returns (output, None)."""

    def __init__(self, width: int, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj, self.v_proj = (nn.Linear(width, kv_heads * self.head_dim, bias=False) for _ in "kv")
        self.o_proj = nn.Linear(width, width, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        B, L, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(hidden_states).view(B, L, self.num_key_value_heads, self.head_dim).transpose(1, 2)
            for p in (self.k_proj, self.v_proj)
        )
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(y), None


class LlamaRMSNorm(nn.Module):
    """Hugging Face's: found by its name, ``weight`` and ``variance_epsilon``; float32 inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(width)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class LlamaBlock(nn.Module):
    """RMSNorms (the second of ``second_norm``'s kind), grouped-query attention passed its input by keyword, an MLP
    ``widen`` times wider in a module of its own with dropout after its second layer, and dropout on the residual
    stream."""

    def __init__(
        self, width: int, heads: int = 4, kv_heads: int = 2, widen: int = 3, second_norm: type = nn.RMSNorm
    ) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(width), second_norm(width)
        self.self_attn = LlamaAttention(width, heads, kv_heads)
        hidden = widen * width
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.SiLU(), nn.Linear(hidden, width), nn.Dropout(0.2))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.self_attn(hidden_states=self.input_layernorm(x))[0])
        return x + self.mlp(self.post_attention_layernorm(x))


class WholeAttentionBlock(nn.Module):
    """A LayerNorm and nanoGPT's own attention (``heads`` of them), which reads its widths from its input and is left
    whole: it gets every token."""

    def __init__(self, width: int, heads: int = 2) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(width), CausalSelfAttention(width)
        self.attn.n_head = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))
