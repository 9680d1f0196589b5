"""Transformer blocks and the LN-LSTM against hand-written float64 references."""

import math

import numpy as np
import pytest
import torch

import layernorm
from layernorm import reference
from layernorm.nn import (
    LayerNormLSTM,
    LayerNormLSTMCell,
    SelfAttention,
    SequenceTransformer,
    TokenBatchNorm,
    TransformerBlock,
    TransformerStack,
    make_norm,
)

D, HEADS, DFF = 8, 2, 12


def _randomize_norms(module: torch.nn.Module) -> None:
    """Gains and biases away from 1 and 0, so a norm applied in the wrong place shows."""
    for m in module.modules():
        if isinstance(m, torch.nn.LayerNorm | torch.nn.RMSNorm) and m.weight is not None:
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)


def ln_ref(x: np.ndarray, m: torch.nn.LayerNorm) -> np.ndarray:
    y, _, _ = reference.layer_norm(
        x, m.normalized_shape, m.weight.detach().numpy(), m.bias.detach().numpy(), m.eps
    )
    return y


def attention_ref(h: np.ndarray, attn: SelfAttention, causal: bool = False) -> np.ndarray:
    """Multi-head softmax attention written out in NumPy float64."""
    _, t, d = h.shape
    dk = d // attn.n_heads
    qkv = h @ attn.qkv.weight.detach().numpy().T + attn.qkv.bias.detach().numpy()
    q, k, v = qkv[..., :d], qkv[..., d : 2 * d], qkv[..., 2 * d :]
    out = np.empty_like(h)
    for head in range(attn.n_heads):
        sl = slice(head * dk, (head + 1) * dk)
        scores = q[..., sl] @ k[..., sl].transpose(0, 2, 1) / math.sqrt(dk)
        if causal:
            scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[..., sl] = p @ v[..., sl]
    return out @ attn.out.weight.detach().numpy().T + attn.out.bias.detach().numpy()


def ffn_ref(h: np.ndarray, block: TransformerBlock) -> np.ndarray:
    f = block.ffn
    a = np.maximum(h @ f.linear1.weight.detach().numpy().T + f.linear1.bias.detach().numpy(), 0)
    return a @ f.linear2.weight.detach().numpy().T + f.linear2.bias.detach().numpy()


def block_ref(h: np.ndarray, block: TransformerBlock, causal: bool = False) -> np.ndarray:
    """The seeds' formulas: post h = LN(h + F(h)); pre h = h + F(LN(h))."""
    if block.norm_position == "post":
        h = ln_ref(h + attention_ref(h, block.attn, causal), block.norm1)
        return ln_ref(h + ffn_ref(h, block), block.norm2)
    h = h + attention_ref(ln_ref(h, block.norm1), block.attn, causal)
    return h + ffn_ref(ln_ref(h, block.norm2), block)


@pytest.mark.parametrize("position", ["pre", "post"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_matches_hand_written_reference(position, causal):
    block = TransformerBlock(D, HEADS, DFF, norm_position=position, dtype=torch.float64)
    _randomize_norms(block)
    x = torch.randn(3, 5, D, dtype=torch.float64)
    got = block(x, is_causal=causal).detach().numpy()
    np.testing.assert_allclose(got, block_ref(x.numpy(), block, causal), rtol=1e-10, atol=1e-12)


class _Known(torch.nn.Module):
    """A sublayer with a known formula, standing in for attention or the FFN."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h, *args):
        return self.fn(h)


def test_pre_and_post_ordering_with_known_sublayers():
    """With F_attn(h) = 2h + 1 and F_ffn(h) = h², the two orderings are checked by hand."""
    x = torch.randn(2, 4, D, dtype=torch.float64)
    outs = {}
    for position in ("pre", "post"):
        block = TransformerBlock(D, HEADS, DFF, norm_position=position, dtype=torch.float64)
        _randomize_norms(block)
        block.attn = _Known(lambda h: 2 * h + 1)
        block.ffn = _Known(lambda h: h * h)
        n1 = lambda z, b=block: ln_ref(z, b.norm1)  # noqa: E731
        n2 = lambda z, b=block: ln_ref(z, b.norm2)  # noqa: E731
        h = x.numpy()
        if position == "post":
            h1 = n1(h + (2 * h + 1))
            want = n2(h1 + h1 * h1)
        else:
            a = n1(h)
            h1 = h + (2 * a + 1)
            b = n2(h1)
            want = h1 + b * b
        outs[position] = block(x).detach().numpy()
        np.testing.assert_allclose(outs[position], want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(outs["pre"], outs["post"])


def test_post_ln_output_is_normalized_and_pre_ln_is_not():
    x = 3 + 5 * torch.randn(2, 6, D)
    post = TransformerBlock(D, HEADS, DFF, norm_position="post")(x)
    pre = TransformerBlock(D, HEADS, DFF, norm_position="pre")(x)
    # gains 1, biases 0 at init: post's rows have mean 0, variance 1 (up to eps)
    torch.testing.assert_close(post.mean(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)
    torch.testing.assert_close(post.var(-1, unbiased=False), torch.ones(2, 6), atol=1e-3, rtol=0)
    assert pre.mean(-1).abs().max() > 1  # the residual stream keeps the input's offset


def test_attention_mask_matches_reference():
    attn = SelfAttention(D, HEADS, dtype=torch.float64)
    h = torch.randn(2, 5, D, dtype=torch.float64)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    torch.testing.assert_close(attn(h, attn_mask=mask), attn(h, is_causal=True))
    np.testing.assert_allclose(
        attn(h, is_causal=True).detach().numpy(), attention_ref(h.numpy(), attn, True), atol=1e-12
    )


@pytest.mark.parametrize("position", ["pre", "post"])
def test_stack_is_blocks_then_final_norm_for_pre(position):
    stack = TransformerStack(3, D, HEADS, DFF, norm_position=position, dtype=torch.float64)
    _randomize_norms(stack)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    h = x
    for layer in stack.layers:
        h = layer(h)
    if position == "pre":
        assert isinstance(stack.final_norm, layernorm.LayerNorm)
        h = torch.from_numpy(ln_ref(h.detach().numpy(), stack.final_norm))
    else:
        assert isinstance(stack.final_norm, torch.nn.Identity)
    torch.testing.assert_close(stack(x), h)
    assert len(TransformerStack(2, D, HEADS, DFF, "post", final_norm=True).final_norm.weight) == D


@pytest.mark.parametrize(
    ("norm", "cls"),
    [
        ("layer", layernorm.LayerNorm),
        ("rms", layernorm.RMSNorm),
        ("batch", TokenBatchNorm),
        ("none", torch.nn.Identity),
    ],
)
def test_norm_variants(norm, cls):
    block = TransformerBlock(D, HEADS, DFF, norm=norm)
    assert isinstance(block.norm1, cls) and isinstance(block.norm2, cls)
    x = torch.randn(4, 3, D, requires_grad=True)
    block(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_rms_block_matches_reference():
    block = TransformerBlock(D, HEADS, DFF, norm="rms", norm_position="post", dtype=torch.float64)
    _randomize_norms(block)
    x = torch.randn(2, 3, D, dtype=torch.float64)

    def rms(z, m):
        return reference.rms_norm(z, D, m.weight.detach().numpy(), m.eps)[0]

    h = x.numpy()
    h = rms(h + attention_ref(h, block.attn), block.norm1)
    want = rms(h + ffn_ref(h, block), block.norm2)
    np.testing.assert_allclose(block(x).detach().numpy(), want, rtol=1e-10, atol=1e-12)


def test_token_batch_norm_normalizes_over_batch_and_time_per_feature():
    m = TokenBatchNorm(D, dtype=torch.float64)
    x = 2 + 3 * torch.randn(4, 6, D, dtype=torch.float64)
    y = m(x)
    flat = x.reshape(-1, D)
    want = (flat - flat.mean(0)) / torch.sqrt(flat.var(0, unbiased=False) + m.eps)
    torch.testing.assert_close(y.reshape(-1, D), want)
    # torch's own BatchNorm1d on the (N, C, L) layout agrees, running statistics included
    bn = torch.nn.BatchNorm1d(D, dtype=torch.float64)
    torch.testing.assert_close(y, bn(x.transpose(1, 2)).transpose(1, 2))
    torch.testing.assert_close(m.running_mean, bn.running_mean)
    torch.testing.assert_close(m.running_var, bn.running_var)
    assert set(m.state_dict()) == set(bn.state_dict())


def test_block_gradcheck():
    for position in ("pre", "post"):
        block = TransformerBlock(4, 2, 6, norm_position=position, dtype=torch.float64)
        x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(block, (x,))


def test_sequence_transformer_shapes_and_dropout_off_in_eval():
    model = SequenceTransformer(11, 9, 2, D, HEADS, DFF, norm_position="post", dropout=0.5)
    tokens = torch.randint(0, 11, (3, 7))
    assert model(tokens).shape == (3, 7, 11)
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)


def test_block_errors():
    with pytest.raises(ValueError, match="norm_position must be 'pre' or 'post'"):
        TransformerBlock(D, HEADS, DFF, norm_position="middle")
    with pytest.raises(ValueError, match="norm must be one of"):
        TransformerBlock(D, HEADS, DFF, norm="group")
    with pytest.raises(ValueError, match="n_heads=3 must divide d_model=8"):
        TransformerBlock(D, 3, DFF)
    with pytest.raises(ValueError, match="activation must be 'relu' or 'gelu'"):
        TransformerBlock(D, HEADS, DFF, activation="tanh")
    with pytest.raises(ValueError, match="norm must be one of"):
        make_norm("weight", D)


# --------------------------------------------------------------------------------------
# LSTM


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def lstm_cell_ref(x, h, c, cell: LayerNormLSTMCell):
    """Ba et al. (2016): gates = LN(W_h h) + LN(W_x x) + b; h' = σ(o) tanh(LN(c'))."""
    w_ih, w_hh = cell.weight_ih.detach().numpy(), cell.weight_hh.detach().numpy()
    gates = ln_ref(h @ w_hh.T, cell.norm_hh) + ln_ref(x @ w_ih.T, cell.norm_ih)
    gates = gates + cell.bias.detach().numpy()
    i, f, g, o = np.split(gates, 4, axis=-1)
    c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(g)
    h = _sigmoid(o) * np.tanh(ln_ref(c, cell.norm_c))
    return h, c


def test_ln_lstm_cell_matches_hand_written_reference():
    cell = LayerNormLSTMCell(3, 5, dtype=torch.float64)
    _randomize_norms(cell)
    x = torch.randn(4, 3, dtype=torch.float64)
    h0, c0 = torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    h, c = cell(x, (h0, c0))
    h_ref, c_ref = lstm_cell_ref(x.numpy(), h0.numpy(), c0.numpy(), cell)
    np.testing.assert_allclose(h.detach().numpy(), h_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(c.detach().numpy(), c_ref, rtol=1e-12, atol=1e-13)
    # state None means zeros
    h_zero, _ = cell(x)
    h_ref, _ = lstm_cell_ref(x.numpy(), np.zeros((4, 5)), np.zeros((4, 5)), cell)
    np.testing.assert_allclose(h_zero.detach().numpy(), h_ref, rtol=1e-12, atol=1e-13)


def test_plain_cell_is_torch_lstm_cell():
    ours = LayerNormLSTMCell(3, 5, norm="none", dtype=torch.float64)
    theirs = torch.nn.LSTMCell(3, 5, dtype=torch.float64)
    with torch.no_grad():
        ours.weight_ih.copy_(theirs.weight_ih)
        ours.weight_hh.copy_(theirs.weight_hh)
        ours.bias.copy_(theirs.bias_ih + theirs.bias_hh)
    x = torch.randn(4, 3, dtype=torch.float64)
    state = (torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64))
    for a, b in zip(ours(x, state), theirs(x, state), strict=True):
        torch.testing.assert_close(a, b)


def test_plain_layer_is_torch_lstm_two_layers_batch_first():
    ours = LayerNormLSTM(3, 5, num_layers=2, norm="none", batch_first=True, dtype=torch.float64)
    theirs = torch.nn.LSTM(3, 5, num_layers=2, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        for k, cell in enumerate(ours.cells):
            cell.weight_ih.copy_(getattr(theirs, f"weight_ih_l{k}"))
            cell.weight_hh.copy_(getattr(theirs, f"weight_hh_l{k}"))
            cell.bias.copy_(getattr(theirs, f"bias_ih_l{k}") + getattr(theirs, f"bias_hh_l{k}"))
    x = torch.randn(4, 7, 3, dtype=torch.float64)
    state = (torch.randn(2, 4, 5, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64))
    out, (h, c) = ours(x, state)
    out_t, (h_t, c_t) = theirs(x, state)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(h, h_t)
    torch.testing.assert_close(c, c_t)


def test_ln_lstm_layer_is_its_cell_unrolled():
    lstm = LayerNormLSTM(3, 5, dtype=torch.float64)
    _randomize_norms(lstm)
    x = torch.randn(6, 2, 3, dtype=torch.float64)  # (T, B, input)
    out, (h_n, c_n) = lstm(x)
    h, c = np.zeros((2, 5)), np.zeros((2, 5))
    for t in range(6):
        h, c = lstm_cell_ref(x[t].numpy(), h, c, lstm.cells[0])
        np.testing.assert_allclose(out[t].detach().numpy(), h, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(h_n[0].detach().numpy(), h, rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(c_n[0].detach().numpy(), c, rtol=1e-11, atol=1e-12)


def test_ln_lstm_statistics_are_per_example_and_per_step():
    """A sequence's outputs do not depend on the other sequences in its batch."""
    lstm = LayerNormLSTM(3, 6, batch_first=True, dtype=torch.float64)
    x = torch.randn(5, 9, 3, dtype=torch.float64)
    alone, _ = lstm(x[2:3])
    other = x.clone()
    other[[0, 1, 3, 4]] *= 100  # wildly different companions
    together, _ = lstm(other)
    torch.testing.assert_close(together[2:3], alone, rtol=1e-12, atol=1e-13)


def test_lstm_norm_variants_and_errors():
    cell = LayerNormLSTMCell(3, 4, norm="rms")
    assert all(isinstance(m, layernorm.RMSNorm) for m in (cell.norm_ih, cell.norm_hh, cell.norm_c))
    assert cell.norm_ih.normalized_shape == (16,) and cell.norm_c.normalized_shape == (4,)
    assert torch.equal(cell.bias[4:8], torch.ones(4)) and torch.equal(cell.bias[:4], torch.zeros(4))
    with pytest.raises(ValueError, match="needs separate statistics per time step"):
        LayerNormLSTMCell(3, 4, norm="batch")
    with pytest.raises(ValueError, match="norm must be 'layer', 'rms' or 'none'"):
        LayerNormLSTM(3, 4, norm="group")


def test_ln_lstm_gradcheck():
    lstm = LayerNormLSTM(2, 3, dtype=torch.float64)
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: lstm(z)[0], (x,))


def test_blocks_use_this_librarys_kernels(monkeypatch):
    calls = []
    real = layernorm.nn.modules.layer_norm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(layernorm.nn.modules, "layer_norm", spy)
    TransformerStack(2, D, HEADS, DFF, "pre")(torch.randn(1, 3, D))
    assert len(calls) == 5  # two per block and the final norm
    calls.clear()
    LayerNormLSTM(2, 3)(torch.randn(4, 1, 2))
    assert len(calls) == 1 + 2 * 4  # inputs once for all steps; hidden and cell per step
