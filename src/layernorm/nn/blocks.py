r"""Transformer blocks with the normalization before (Pre-LN) or after (Post-LN) each residual.

For a sublayer ``F`` (self-attention, or the position-wise feed-forward network)::

    Post-LN (Vaswani et al. 2017):  h = Norm(h + F(h))
    Pre-LN  (Xiong et al. 2020):    h = h + F(Norm(h))

and a Pre-LN stack ends with one more ``Norm`` before the output, as in Xiong et al.
``Norm`` is this library's :class:`~layernorm.LayerNorm` (``norm="layer"``), its
:class:`~layernorm.RMSNorm` (``"rms"``), batch normalization over (batch, time) per feature
(``"batch"``, :class:`TokenBatchNorm`) or nothing (``"none"``), so the variants can be
compared in one model.

Linear weights start Xavier-uniform with zero biases (the initialization Xiong et al.
analyse, and the one :class:`torch.nn.MultiheadAttention` uses); norms start at gain 1,
bias 0.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .modules import LayerNorm, RMSNorm

__all__ = [
    "FeedForward",
    "NormKind",
    "NormPosition",
    "SelfAttention",
    "SequenceTransformer",
    "TokenBatchNorm",
    "TransformerBlock",
    "TransformerStack",
    "make_norm",
]

NormKind = Literal["layer", "rms", "batch", "none"]
NormPosition = Literal["pre", "post"]
NORM_KINDS: tuple[str, ...] = ("layer", "rms", "batch", "none")


class TokenBatchNorm(torch.nn.BatchNorm1d):
    r"""Batch normalization of the last dim, with statistics over every other dim.

    For an input of shape ``(B, T, C)`` each feature ``c`` is normalized with the mean and
    variance of its ``B·T`` values (batch and time together), the usual way to put batch
    norm into a sequence model. A :class:`torch.nn.BatchNorm1d` (same parameters, buffers
    and state_dict keys) that accepts ``(*, C)``.

    Args:
        num_features: ``C``, the size of the last dim.
        eps, momentum, affine, track_running_stats, device, dtype: as in
            :class:`torch.nn.BatchNorm1d`.

    Shape:
        - Input: ``(*, C)``
        - Output: same as input

    Example::

        >>> m = TokenBatchNorm(8)
        >>> m(torch.randn(4, 5, 8)).shape
        torch.Size([4, 5, 8])
    """

    def forward(self, input: Tensor) -> Tensor:
        rows = input.reshape(-1, input.shape[-1])
        return super().forward(rows).view(input.shape)


def make_norm(
    norm: str,
    d_model: int,
    eps: float = 1e-5,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """The normalization module named ``norm`` ("layer", "rms", "batch" or "none") over ``d_model``.

    Args:
        norm: which normalization.
        d_model: size of the normalized (last) dim.
        eps: added inside the square root. Default: ``1e-5``.
        device, dtype: of the parameters. Default: ``None``.

    Returns:
        :class:`~layernorm.LayerNorm`, :class:`~layernorm.RMSNorm`, :class:`TokenBatchNorm` or
        :class:`torch.nn.Identity`.
    """
    kw: dict[str, Any] = {"device": device, "dtype": dtype}
    if norm == "layer":
        return LayerNorm(d_model, eps=eps, **kw)
    if norm == "rms":
        return RMSNorm(d_model, eps=eps, **kw)
    if norm == "batch":
        return TokenBatchNorm(d_model, eps=eps, **kw)
    if norm == "none":
        return torch.nn.Identity()
    raise ValueError(f"norm must be one of {list(NORM_KINDS)}, got {norm!r}")


def _xavier_(linear: torch.nn.Linear) -> None:
    torch.nn.init.xavier_uniform_(linear.weight)
    if linear.bias is not None:
        torch.nn.init.zeros_(linear.bias)


class SelfAttention(torch.nn.Module):
    r"""Multi-head self-attention through :func:`torch.nn.functional.scaled_dot_product_attention`.

    .. math::
        \mathrm{Attn}(h) = \mathrm{concat}_k\big(\mathrm{softmax}(q_k k_k^\top/\sqrt{d_k}) v_k\big) W_o

    with ``q, k, v = h W_{qkv}`` split into ``n_heads`` heads of ``d_k = d_model / n_heads``.

    Args:
        d_model: feature size.
        n_heads: number of heads; must divide ``d_model``.
        dropout: attention-probability dropout in training. Default: ``0.0``.
        bias: learn biases in the projections. Default: ``True``.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(B, T, d_model)``
        - Output: ``(B, T, d_model)``
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=bias, **kw)
        self.out = torch.nn.Linear(d_model, d_model, bias=bias, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _xavier_(self.qkv)
        _xavier_(self.out)

    def forward(
        self, h: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
        )
        return self.out(a.transpose(1, 2).reshape(b, t, d))


class FeedForward(torch.nn.Module):
    r"""Position-wise feed-forward network: ``FFN(h) = act(h W_1 + b_1) W_2 + b_2``.

    Args:
        d_model: feature size.
        d_ff: hidden size.
        dropout: dropout after the activation, in training. Default: ``0.0``.
        activation: ``"relu"`` (as in Vaswani et al. and Xiong et al.) or ``"gelu"``.
            Default: ``"relu"``.
        bias: learn ``b_1``, ``b_2``. Default: ``True``.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(*, d_model)``
        - Output: ``(*, d_model)``
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: Literal["relu", "gelu"] = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.linear1 = torch.nn.Linear(d_model, d_ff, bias=bias, **kw)
        self.linear2 = torch.nn.Linear(d_ff, d_model, bias=bias, **kw)
        self.activation = F.relu if activation == "relu" else F.gelu
        self.dropout = torch.nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _xavier_(self.linear1)
        _xavier_(self.linear2)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(h))))


class TransformerBlock(torch.nn.Module):
    r"""One Transformer encoder block: self-attention and a feed-forward network, each in a residual.

    .. math::
        \text{post:}\quad h \leftarrow \mathrm{Norm}_1(h + \mathrm{Attn}(h)),\quad
                          h \leftarrow \mathrm{Norm}_2(h + \mathrm{FFN}(h))

        \text{pre:}\quad  h \leftarrow h + \mathrm{Attn}(\mathrm{Norm}_1(h)),\quad
                          h \leftarrow h + \mathrm{FFN}(\mathrm{Norm}_2(h))

    Args:
        d_model: feature size.
        n_heads: attention heads; must divide ``d_model``.
        d_ff: hidden size of the feed-forward network.
        norm_position: ``"pre"`` or ``"post"``. Default: ``"pre"``.
        norm: ``"layer"``, ``"rms"``, ``"batch"`` or ``"none"``. Default: ``"layer"``.
        dropout: on attention probabilities, the FFN hidden layer and each sublayer's
            output, in training. Default: ``0.0``.
        eps: of the norms. Default: ``1e-5``.
        activation: of the FFN, ``"relu"`` or ``"gelu"``. Default: ``"relu"``.
        bias: learn biases in the linear layers. Default: ``True``.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(B, T, d_model)``
        - Output: ``(B, T, d_model)``

    Example::

        >>> block = TransformerBlock(32, 4, 64, norm_position="post")
        >>> block(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        norm_position: NormPosition = "pre",
        norm: NormKind = "layer",
        dropout: float = 0.0,
        eps: float = 1e-5,
        activation: Literal["relu", "gelu"] = "relu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {norm_position!r}")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.norm_position = norm_position
        self.attn = SelfAttention(d_model, n_heads, dropout, bias, **kw)
        self.ffn = FeedForward(d_model, d_ff, dropout, activation, bias, **kw)
        self.norm1 = make_norm(norm, d_model, eps, **kw)
        self.norm2 = make_norm(norm, d_model, eps, **kw)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(
        self, h: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        def attn(z: Tensor) -> Tensor:
            return self.dropout(self.attn(z, attn_mask, is_causal))

        def ffn(z: Tensor) -> Tensor:
            return self.dropout(self.ffn(z))

        if self.norm_position == "post":
            h = self.norm1(h + attn(h))
            return self.norm2(h + ffn(h))
        h = h + attn(self.norm1(h))
        return h + ffn(self.norm2(h))

    def extra_repr(self) -> str:
        return f"norm_position={self.norm_position!r}"


class TransformerStack(torch.nn.Module):
    r"""``n_layers`` :class:`TransformerBlock` s, and for Pre-LN a final norm (Xiong et al. 2020).

    .. math::
        h_L = \mathrm{Block}_L \circ \cdots \circ \mathrm{Block}_1(h_0),\qquad
        \text{output} = \mathrm{Norm}_f(h_L)\ \text{(pre)}\quad\text{or}\quad h_L\ \text{(post)}

    Args:
        n_layers: number of blocks ``L``.
        d_model, n_heads, d_ff, norm_position, norm, dropout, eps, activation, bias:
            as in :class:`TransformerBlock`.
        final_norm: add ``Norm_f``. Default: ``None``, meaning yes for Pre-LN and no for
            Post-LN (whose last block already ends with a norm).
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(B, T, d_model)``
        - Output: ``(B, T, d_model)``

    Example::

        >>> stack = TransformerStack(3, 32, 4, 64, norm_position="pre")
        >>> stack(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        norm_position: NormPosition = "pre",
        norm: NormKind = "layer",
        dropout: float = 0.0,
        eps: float = 1e-5,
        activation: Literal["relu", "gelu"] = "relu",
        bias: bool = True,
        final_norm: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.layers = torch.nn.ModuleList(
            TransformerBlock(
                d_model, n_heads, d_ff, norm_position, norm, dropout, eps, activation, bias, **kw
            )
            for _ in range(n_layers)
        )
        if final_norm is None:
            final_norm = norm_position == "pre"
        self.final_norm = make_norm(norm, d_model, eps, **kw) if final_norm else torch.nn.Identity()

    def forward(
        self, h: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False
    ) -> Tensor:
        for layer in self.layers:
            h = layer(h, attn_mask, is_causal)
        return self.final_norm(h)


class SequenceTransformer(torch.nn.Module):
    r"""A tiny token-to-token model: embeddings, a :class:`TransformerStack`, a linear read-out.

    .. math::
        \text{logits} = \mathrm{Stack}(E[\text{tokens}] + P[0{:}T])\, W_{out} + b_{out}

    Args:
        vocab_size: number of token ids (input and output).
        max_len: longest sequence (size of the learned position table ``P``).
        n_layers, d_model, n_heads, d_ff, norm_position, norm, dropout, eps, activation:
            as in :class:`TransformerStack`.
        device, dtype: of the parameters. Default: ``None``.

    Shape:
        - Input: ``(B, T)`` integer token ids, ``T <= max_len``
        - Output: ``(B, T, vocab_size)`` logits

    Example::

        >>> model = SequenceTransformer(10, 16, 2, 32, 4, 64, norm_position="post")
        >>> model(torch.randint(0, 10, (3, 16))).shape
        torch.Size([3, 16, 10])
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        n_layers: int,
        d_model: int,
        n_heads: int,
        d_ff: int,
        norm_position: NormPosition = "pre",
        norm: NormKind = "layer",
        dropout: float = 0.0,
        eps: float = 1e-5,
        activation: Literal["relu", "gelu"] = "relu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.embed = torch.nn.Embedding(vocab_size, d_model, **kw)
        self.position = torch.nn.Parameter(torch.empty(max_len, d_model, **kw))
        self.stack = TransformerStack(
            n_layers, d_model, n_heads, d_ff, norm_position, norm, dropout, eps, activation, **kw
        )
        self.readout = torch.nn.Linear(d_model, vocab_size, **kw)
        torch.nn.init.normal_(self.position)
        _xavier_(self.readout)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.readout(self.stack(h))
