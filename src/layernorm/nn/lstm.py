r"""The layer-normalized LSTM of Ba, Kiros & Hinton (2016), and the plain LSTM beside it.

At every time step ``t``, with statistics computed afresh for that step and that example::

    (i, f, g, o) = LN(W_h h_{t-1}; γ_h, β_h) + LN(W_x x_t; γ_x, β_x) + b
    c_t = σ(f) ⊙ c_{t-1} + σ(i) ⊙ tanh(g)
    h_t = σ(o) ⊙ tanh(LN(c_t; γ_c, β_c))

Each ``LN`` normalizes the whole ``4H`` gate pre-activation vector (``H`` for the cell),
as in the paper. The gates are stacked in torch's order ``(i, f, g, o)``, so that with
``norm="none"`` the cell is exactly :class:`torch.nn.LSTMCell` with ``b = b_ih + b_hh``.
``norm="rms"`` uses :class:`~layernorm.RMSNorm` instead.
"""

from __future__ import annotations

import math
from typing import Any, Literal, cast

import torch
from torch import Tensor

from .modules import LayerNorm, RMSNorm

__all__ = ["LayerNormLSTM", "LayerNormLSTMCell"]

LSTMNorm = Literal["layer", "rms", "none"]


def _norm(norm: str, size: int, eps: float, **kw) -> torch.nn.Module:
    if norm == "layer":
        return LayerNorm(size, eps=eps, **kw)
    if norm == "rms":
        return RMSNorm(size, eps=eps, **kw)
    if norm == "none":
        return torch.nn.Identity()
    if norm == "batch":
        raise ValueError(
            "norm='batch' is not offered for the LSTM: batch norm in a recurrent network "
            "needs separate statistics per time step (Cooijmans et al. 2017); "
            "use 'layer', 'rms' or 'none'"
        )
    raise ValueError(f"norm must be 'layer', 'rms' or 'none', got {norm!r}")


class LayerNormLSTMCell(torch.nn.Module):
    r"""One step of an LSTM with layer normalization per time step (Ba et al. 2016).

    .. math::
        (i, f, g, o) = \mathrm{LN}_h(W_{hh} h) + \mathrm{LN}_x(W_{ih} x) + b,\quad
        c' = \sigma(f) \odot c + \sigma(i) \odot \tanh(g),\quad
        h' = \sigma(o) \odot \tanh(\mathrm{LN}_c(c'))

    Args:
        input_size: features of ``x``.
        hidden_size: ``H``, features of ``h`` and ``c``.
        norm: ``"layer"`` (the LN-LSTM), ``"rms"``, or ``"none"`` (a plain LSTM, equal to
            :class:`torch.nn.LSTMCell`). Default: ``"layer"``.
        eps: of the norms. Default: ``1e-5``.
        forget_bias: initial value of the forget gate's part of ``b``. Default: ``1.0``.
        device, dtype: of the parameters. Default: ``None``.

    Attributes:
        weight_ih: ``(4H, input_size)``, uniform in ``±1/sqrt(H)`` as in torch.
        weight_hh: ``(4H, H)``, likewise.
        bias: ``(4H,)``, zero except ``forget_bias`` on the forget gate.
        norm_ih, norm_hh (over ``4H``), norm_c (over ``H``): the norms (Identity for "none").

    Shape:
        - Input: ``x`` of ``(B, input_size)``, ``state`` a pair of ``(B, H)`` or ``None`` (zeros)
        - Output: ``(h', c')``, each ``(B, H)``

    Example::

        >>> cell = LayerNormLSTMCell(3, 8)
        >>> h, c = cell(torch.randn(5, 3))
        >>> h.shape, c.shape
        (torch.Size([5, 8]), torch.Size([5, 8]))
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        norm: LSTMNorm = "layer",
        eps: float = 1e-5,
        forget_bias: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.norm = norm
        self.forget_bias = forget_bias
        self.weight_ih = torch.nn.Parameter(torch.empty(4 * hidden_size, input_size, **kw))
        self.weight_hh = torch.nn.Parameter(torch.empty(4 * hidden_size, hidden_size, **kw))
        self.bias = torch.nn.Parameter(torch.empty(4 * hidden_size, **kw))
        self.norm_ih = _norm(norm, 4 * hidden_size, eps, **kw)
        self.norm_hh = _norm(norm, 4 * hidden_size, eps, **kw)
        self.norm_c = _norm(norm, hidden_size, eps, **kw)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        torch.nn.init.uniform_(self.weight_ih, -bound, bound)
        torch.nn.init.uniform_(self.weight_hh, -bound, bound)
        with torch.no_grad():
            self.bias.zero_()
            self.bias[self.hidden_size : 2 * self.hidden_size] = self.forget_bias
        for m in (self.norm_ih, self.norm_hh, self.norm_c):
            reset = getattr(m, "reset_parameters", None)  # nn.Identity has none
            if callable(reset):
                reset()

    def input_gates(self, x: Tensor) -> Tensor:
        """``LN_x(W_ih x)``: the input's part of the gates, for any number of leading dims.

        A layer computes it for every time step at once (the statistics are still per step).
        """
        return self.norm_ih(x @ self.weight_ih.T)

    def step(self, gx: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """One step from the precomputed input gates ``gx = input_gates(x)``."""
        h, c = state
        gates = self.norm_hh(h @ self.weight_hh.T) + gx + self.bias
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(self.norm_c(c))
        return h, c

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        if state is None:
            zeros = x.new_zeros(x.shape[0], self.hidden_size)
            state = (zeros, zeros)
        return self.step(self.input_gates(x), state)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, norm={self.norm!r}"


class LayerNormLSTM(torch.nn.Module):
    r"""A (stacked) LSTM built from :class:`LayerNormLSTMCell`, with torch.nn.LSTM's interface.

    Each layer runs its cell over time; layer ``k > 0`` reads the hidden states of layer
    ``k - 1``. The input part ``LN_x(W_ih x_t)`` is computed for all steps in one call,
    with per-step statistics all the same.

    Args:
        input_size: features of ``x``.
        hidden_size: ``H``.
        num_layers: stacked layers. Default: ``1``.
        norm: ``"layer"``, ``"rms"`` or ``"none"``. Default: ``"layer"``.
        batch_first: input and output are ``(B, T, ·)`` instead of ``(T, B, ·)``.
            Default: ``False``.
        eps, forget_bias, device, dtype: as in :class:`LayerNormLSTMCell`.

    Returns:
        ``(output, (h_n, c_n))``: the last layer's hidden states at every step, and each
        layer's final ``h`` and ``c`` stacked to ``(num_layers, B, H)``.

    Shape:
        - Input: ``(T, B, input_size)`` (or ``(B, T, input_size)`` if ``batch_first``), and
          an optional ``(h_0, c_0)`` of ``(num_layers, B, H)`` each
        - Output: ``(T, B, H)`` (or ``(B, T, H)``)

    Example::

        >>> lstm = LayerNormLSTM(2, 16, batch_first=True)
        >>> out, (h, c) = lstm(torch.randn(4, 30, 2))
        >>> out.shape, h.shape
        (torch.Size([4, 30, 16]), torch.Size([1, 4, 16]))
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        norm: LSTMNorm = "layer",
        batch_first: bool = False,
        eps: float = 1e-5,
        forget_bias: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.batch_first = batch_first
        self.cells = torch.nn.ModuleList(
            LayerNormLSTMCell(
                input_size if k == 0 else hidden_size, hidden_size, norm, eps, forget_bias, **kw
            )
            for k in range(num_layers)
        )

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        if self.batch_first:
            x = x.transpose(0, 1)
        if state is None:
            zeros = x.new_zeros(self.num_layers, x.shape[1], self.hidden_size)
            state = (zeros, zeros)
        h_n, c_n = [], []
        for k, module in enumerate(self.cells):
            cell = cast(LayerNormLSTMCell, module)
            gx = cell.input_gates(x)
            hc = (state[0][k], state[1][k])
            outputs = []
            for t in range(x.shape[0]):
                hc = cell.step(gx[t], hc)
                outputs.append(hc[0])
            x = torch.stack(outputs)
            h_n.append(hc[0])
            c_n.append(hc[1])
        if self.batch_first:
            x = x.transpose(0, 1)
        return x, (torch.stack(h_n), torch.stack(c_n))
