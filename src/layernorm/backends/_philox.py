"""Counter-based dropout masks: Philox4x32-10 keyed by (seed, row, column), each call's
four words the masks of four consecutive elements, with ``tl.rand``'s uniform, in torch
operations on any device (docs/contract.md §7).

The same ``(seed, p)`` gives the same keep-mask and the same uniforms on every backend
(this module in torch, :mod:`layernorm.backends._numba_philox` inside numba kernels,
:mod:`layernorm.backends._triton_philox` inside Triton kernels), on every device, at any
batch size, layout and thread count: each element's bits are a pure function of the seed
and of its logical position, so a backward regenerates the mask instead of storing it.
Every rule below is written once here. The numba module takes its constants from this
one; the Triton module calls ``tl.philox`` itself, whose constants these are (the tests
compare the three bit for bit).

**Generator.** Philox4x32 with 10 rounds (Salmon et al., "Parallel random numbers: as easy
as 1, 2, 3", SC 2011), the Random123 reference's round function and constants, which are
Triton's (``triton/language/random.py``: ``PHILOX_ROUND_A/B``, ``PHILOX_KEY_A/B``). One
round maps the counter ``(c0, c1, c2, c3)`` and key ``(k0, k1)`` to::

    (hi(M1·c2) ^ c1 ^ k0,  lo(M1·c2),  hi(M0·c0) ^ c3 ^ k1,  lo(M0·c0))

with ``hi``/``lo`` the upper/lower 32 bits of the 64-bit product; then the key is bumped,
``k0 += W0``, ``k1 += W1`` (mod 2^32).

**Key and counter**: the key is the seed's 64 bits, ``k0 = seed mod 2^32``,
``k1 = (seed >> 32) mod 2^32`` (a negative seed is taken modulo 2^64, as Triton's
``seed.to(tl.uint64)`` does). The element at ``offset`` takes output word
``offset mod 4`` of the counter ``(q mod 2^32, q >> 32, stream, 0)``, ``q = offset >> 2``:
one Philox call gives the words of four consecutive elements (``tl.randint4x(seed, q)``
for stream 0), a quarter of the cost of a call per element (``tl.randint(seed, offset)``,
which keeps one word of four). ``stream`` 0 is a dropout's mask; stream 1 a second,
independent mask of the same elements (the dropout-add's ``x1``,
:mod:`layernorm.backends._dropout_add`), ``stream=1`` below.

**Offset** of the element at row ``r``, column ``c`` of a ``(M, N)`` view:
``offset = r · N + c`` in int64 (:func:`offsets`), the element's index in the logical,
row-major order, whatever the strides: for an input of normalized shape ``S``, ``r`` runs
over the flattened leading dims and ``c`` over the flattened dims of ``S``, so
``N = prod(S)``; when rows or columns are split over programs, chunks or ranks, ``r``,
``c`` and ``N`` stay those of the whole tensor. Limit: ``offset < 2^63``, i.e. any tensor of fewer than 2^63 elements
(larger ones raise ValueError). A Triton kernel computes it in int64
(``row.to(tl.int64) * N + cols``); an int32 offset gives the same bits while it is below
2^31.

**Uniform** (as ``tl.rand``): the word ``x`` read as an int32, ``y = x`` when it is
non-negative and ``~x`` otherwise (so ``0 <= y < 2^31``), then
``u = float32(float32(y) · UNIFORM_SCALE)``, both steps rounded to nearest. So
``0 <= u <= 1 - 2^-24``.

**Keep rule** (flash-attn's ``tl.rand(...) > dropout_p``, with its ``dropout_p > 0``
switch): with ``p32 = float32(p)``, an element is kept iff ``p32 == 0`` or ``u > p32``.
So ``p = 0`` keeps everything and ``p = 1`` drops everything.

**Scaling rule** (:func:`dropout_scale`, :func:`apply_dropout`): the scale is the float64
number ``s = 1 / (1 - p)`` (Python's float64 division and subtraction; ``s = 0`` at
``p = 1``). A kept value ``x`` becomes the exact product ``x · s``, a dropped one ``+0.0``
(NaN and Inf too, as ``tl.where(keep, ..., 0.0)``). Dropout scaling is exact in this
sense: ``x · s`` enters the rest of a computation without rounding, and stored on its
own it is rounded once, to nearest-even in the output's dtype. (Rounding ``x * s`` to
float64 first would round twice: rarely, but the tests hold such a case; flash-attn's float32
``x / (1.0 - dropout_p)`` rounds ``p``, ``1 - p`` and the quotient. ``x · s`` differs from
``x / (1 - p)`` by at most 2^-52 relative, and equals it when ``1 - p`` is a power of
two: ``p = 0.5, 0.75, ...``.)

**Seed rule** (:func:`draw_seed`): a call without a seed draws one with
``torch.randint(2**63 - 1, (), dtype=torch.int64, generator=generator)`` on the
generator's device, by default torch's default CPU generator even for CUDA tensors: so
``torch.manual_seed(s)`` fixes the mask, the same one on the CPU and the GPU, and the
CPU generator advances as that one ``torch.randint`` call advances it.
"""

from __future__ import annotations

import math
import numbers

import torch

from .torch_ import round_once

#: Philox4x32 rounds (Random123's and Triton's default)
ROUNDS = 10
#: multiplier of counter word 0 (Random123 ``PHILOX_M4x32_0``, Triton ``PHILOX_ROUND_A``)
PHILOX_M0 = 0xD2511F53
#: multiplier of counter word 2 (``PHILOX_M4x32_1``, ``PHILOX_ROUND_B``)
PHILOX_M1 = 0xCD9E8D57
#: key bump of k0: the golden ratio's fraction (``PHILOX_W32_0``, ``PHILOX_KEY_A``)
PHILOX_W0 = 0x9E3779B9
#: key bump of k1: sqrt(3) - 1 (``PHILOX_W32_1``, ``PHILOX_KEY_B``)
PHILOX_W1 = 0xBB67AE85
#: ``float32(4.6566127342e-10)`` as ``tl.rand`` writes it: exactly ``2^-31 · (1 - 2^-24)``,
#: the largest float32 with ``float32((2^31 - 1) · scale) < 1``
UNIFORM_SCALE = 2.0**-31 * (1.0 - 2.0**-24)
#: the largest offset (int64)
MAX_OFFSET = 2**63 - 1
#: seeds accepted: any integer in [SEED_MIN, SEED_MAX], taken modulo 2^64
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
#: ``draw_seed`` draws from ``[0, SEED_DRAW_HIGH)``
SEED_DRAW_HIGH = 2**63 - 1

#: elements per chunk of the torch implementation on the CPU (see :func:`random_bits`)
CPU_CHUNK = 16384

_MASK32 = 0xFFFFFFFF
_SIGN32 = 0x80000000


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key ``(k0, k1)`` of ``seed``: its low and high 32 bits, modulo 2^64.

    Raises:
        TypeError: ``seed`` is not an integer (a bool is not one).
        ValueError: ``seed`` is outside ``[-2^63, 2^64 - 1]``.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"dropout seed must be an int, got {type(seed).__name__}")
    seed = int(seed)
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"dropout seed must be in [-2**63, 2**64 - 1], got {seed}")
    return seed & _MASK32, (seed >> 32) & _MASK32


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A seed for a call that was given none, in ``[0, 2^63 - 1)``: one
    ``torch.randint(2**63 - 1, ...)`` draw from ``generator`` (on its device), by default
    from torch's default CPU generator, so that ``torch.manual_seed`` makes it
    reproducible and a CUDA tensor gets the mask a CPU tensor gets."""
    device = torch.device("cpu") if generator is None else generator.device
    draw = torch.randint(SEED_DRAW_HIGH, (), dtype=torch.int64, generator=generator, device=device)
    return int(draw.item())


def check_p(p: float) -> float:
    """``p`` as a float, after checking that it is a probability.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` is NaN or outside [0, 1] (torch's message).
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout probability must be a float, got {type(p).__name__}")
    p = float(p)
    if not 0.0 <= p <= 1.0:  # NaN fails too
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return p


def threshold(p: float) -> float:
    """``p32 = float32(p)`` (round to nearest), the threshold the keep rule compares the
    float32 uniform with."""
    return torch.tensor(check_p(p), dtype=torch.float32).item()


def dropout_scale(p: float) -> float:
    """``s = 1 / (1 - p)`` in float64, the factor of a kept value; 0.0 at ``p = 1``, where
    nothing is kept (torch's ``native_dropout`` does the same)."""
    p = check_p(p)
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)


def offsets(
    n_rows: int,
    n_cols: int,
    row_start: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The ``(n_rows, n_cols)`` int64 offsets ``r · n_cols + c`` of rows
    ``row_start .. row_start + n_rows - 1`` (global row indices) of a tensor of
    ``n_cols`` columns.

    Raises:
        ValueError: a negative size or row, or an offset past 2^63 - 1.
    """
    if n_rows < 0 or n_cols < 0 or row_start < 0:
        raise ValueError(
            f"dropout offsets need non-negative sizes and rows, got n_rows={n_rows}, "
            f"n_cols={n_cols}, row_start={row_start}"
        )
    if n_rows and n_cols and (row_start + n_rows) * n_cols - 1 > MAX_OFFSET:
        raise ValueError(
            f"dropout offsets past 2**63 - 1: rows up to {row_start + n_rows} of {n_cols} columns"
        )
    rows = torch.arange(n_rows, dtype=torch.int64, device=device) + row_start
    cols = torch.arange(n_cols, dtype=torch.int64, device=device)
    return rows[:, None] * n_cols + cols


def _halves(m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # the 16-bit halves of m as 1-element tensors: torch's CPU int64 product with a
    # Python int takes a slow path (5x a tensor product)
    return (
        torch.tensor([m & 0xFFFF], dtype=torch.int64, device=device),
        torch.tensor([m >> 16], dtype=torch.int64, device=device),
    )


def _mulhilo(
    a: torch.Tensor, m: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    # The 64-bit product of a uint32 tensor (held in int64) and a constant of 16-bit halves
    # m, as its high and low words: nothing overflows int64 (signed overflow is undefined
    # in the C++ and CUDA kernels). In place where the temporaries are ours.
    low = a * m[0]  # < 2^48
    mid = (a * m[1]).add_(low >> 16)  # < 2^49
    hi = mid >> 16
    lo = mid.bitwise_and_(0xFFFF).bitwise_left_shift_(16).bitwise_or_(low.bitwise_and_(0xFFFF))
    return hi, lo


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int],
    rounds: int = ROUNDS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-``rounds`` of ``counter`` (four broadcastable int64 tensors of 32-bit
    words, each in ``[0, 2^32)``, on one device) under ``key`` (two 32-bit ints): four
    int64 tensors of 32-bit words. Random123's ``philox4x32_R``, word for word. The
    inputs are not modified."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    m0, m1 = _halves(PHILOX_M0, c0.device), _halves(PHILOX_M1, c0.device)
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, m0)
        hi1, lo1 = _mulhilo(c2, m1)
        # (the words may broadcast: the first round's c2 and c3 are 0-dim zeros)
        c0, c1, c2, c3 = (hi1 ^ c1).bitwise_xor_(k0), lo1, (hi0 ^ c3).bitwise_xor_(k1), lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


def _check_offsets(offset: torch.Tensor) -> None:
    if offset.dtype != torch.int64:
        raise TypeError(f"dropout offsets must be an int64 tensor, got {offset.dtype}")
    if offset.numel() and bool((offset < 0).any()):
        raise ValueError("dropout offsets must be non-negative")


def random_bits(seed: int, offset: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """The random word of each offset in mask stream ``stream`` (0 or 1): output word
    ``offset mod 4`` of Philox's counter ``(q mod 2^32, q >> 32, stream, 0)``,
    ``q = offset >> 2``, as int64 in ``[0, 2^32)``. ``offset``: a non-negative int64
    tensor of any shape and device.

    Raises:
        ValueError: ``stream`` is not 0 or 1.
    """
    if stream not in (0, 1):
        raise ValueError(f"dropout uses Philox streams 0 and 1, got stream={stream}")
    key = seed_key(seed)
    _check_offsets(offset)
    if offset.device.type != "cpu" or offset.numel() <= CPU_CHUNK:
        return _words_of(offset, stream, key)
    # On the CPU, ~200 full-size int64 temporaries would each fault their pages in anew;
    # chunks that stay in the caches take 2-7x less time. The bits are the same.
    flat = offset.reshape(-1)
    words = torch.empty_like(flat)
    for start in range(0, flat.numel(), CPU_CHUNK):
        words[start : start + CPU_CHUNK] = _words_of(flat[start : start + CPU_CHUNK], stream, key)
    return words.reshape(offset.shape)


def _words_of(offset: torch.Tensor, stream: int, key: tuple[int, int]) -> torch.Tensor:
    # word offset & 3 of the counter (q lo, q hi, stream, 0), q = offset >> 2; where the
    # offsets are consecutive (as every caller's rows are), one call per four of them
    c2 = torch.full((), stream, dtype=torch.int64, device=offset.device)
    zero = torch.zeros((), dtype=torch.int64, device=offset.device)
    flat = offset.reshape(-1)
    n = flat.numel()
    if n >= 8 and bool((flat[1:] - flat[:-1] == 1).all()):
        first = int(flat[0])
        q = torch.arange(first >> 2, ((first + n - 1) >> 2) + 1, device=offset.device)
        words = philox4x32((q & _MASK32, q >> 32, c2, zero), key)
        row_major = torch.stack(torch.broadcast_tensors(*words), 1).reshape(-1)
        return row_major[first & 3 : (first & 3) + n].reshape(offset.shape)
    q = offset >> 2
    each = philox4x32((q & _MASK32, q >> 32, c2, zero), key)
    return torch.stack(torch.broadcast_tensors(*each)).gather(0, (offset & 3)[None])[0]


def uniform_from_bits(word: torch.Tensor) -> torch.Tensor:
    """``tl.rand``'s float32 of 32-bit words (int64 in ``[0, 2^32)``), in ``[0, 1)``."""
    # y = ~x of the int32 x when negative: the low 31 bits flipped where bit 31 is set
    # (a product, not torch.where: 3x faster on the CPU)
    flip = torch.tensor([_MASK32 >> 1], dtype=torch.int64, device=word.device)
    y = (word & flip).bitwise_xor_((word >> 31) * flip)
    scale = torch.tensor(UNIFORM_SCALE, dtype=torch.float32, device=word.device)
    return y.to(torch.float32).mul_(scale)


def uniform(seed: int, offset: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """A float32 uniform in ``[0, 1)`` per offset: ``tl.rand``'s conversion of the word of
    mask stream ``stream`` (:func:`random_bits`)."""
    return uniform_from_bits(random_bits(seed, offset, stream))


def keep_from_uniform(u: torch.Tensor, p: float) -> torch.Tensor:
    """The keep rule: True where ``p32 == 0`` or ``u > p32``, ``p32 = float32(p)``."""
    p32 = threshold(p)
    if p32 == 0.0:
        return torch.ones(u.shape, dtype=torch.bool, device=u.device)
    return u > p32


def keep(seed: int, offset: torch.Tensor, p: float, stream: int = 0) -> torch.Tensor:
    """The keep-mask of ``offset`` (bool, same shape) for drop probability ``p``, in mask
    stream ``stream`` (:func:`random_bits`)."""
    p = check_p(p)
    return keep_from_uniform(uniform(seed, offset, stream), p)


def keep_mask(
    seed: int,
    n_rows: int,
    n_cols: int,
    p: float,
    row_start: int = 0,
    device: torch.device | str | None = None,
    stream: int = 0,
) -> torch.Tensor:
    """The ``(n_rows, n_cols)`` keep-mask of rows ``row_start ..`` (global indices), in
    mask stream ``stream`` (:func:`random_bits`)."""
    return keep(seed, offsets(n_rows, n_cols, row_start, device), p, stream)


def _split(s: float) -> tuple[float, float]:
    # s = high + low exactly, high with 29 significant bits and low with at most 24, so
    # that a value of at most 24 bits times either is exact in float64.
    if s == 0.0 or not math.isfinite(s):
        return s, 0.0
    mantissa, exponent = math.frexp(s)
    high = math.ldexp(math.floor(math.ldexp(mantissa, 29)), exponent - 29)
    return high, s - high


def _round_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # a + b (float64) rounded to odd: a + b itself when it is a float64, else the one of
    # its two float64 neighbours whose last bit is 1. Rounding that value to any format of at most
    # 51 bits rounds a + b once (Boldo and Melquiond, "When double rounding is odd").
    t = a + b
    t_b = t - a
    e = (a - (t - t_b)) + (b - t_b)  # TwoSum: t + e == a + b exactly
    bits = t.view(torch.int64)
    # away from zero when e has t's sign, towards zero otherwise; only when t's bit is even
    step = torch.where((e > 0) == (t > 0), 1, -1)
    inexact = (e != 0) & ((bits & 1) == 0)
    return torch.where(inexact, bits + step, bits).view(torch.float64)


def apply_dropout(
    x: torch.Tensor, kept: torch.Tensor, p: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The scaling rule: the exact ``x · dropout_scale(p)`` where ``kept``, rounded once to
    nearest-even in ``dtype`` (default ``x``'s), and ``+0.0`` where not kept.

    ``x``: float16, bfloat16 or float32 (then ``dtype`` is any floating dtype), or float64
    with ``dtype`` float64. ``kept``: bool, broadcastable to ``x``.

    Raises:
        TypeError: ``x`` is not floating, or float64 with a narrower ``dtype``.
    """
    dtype = x.dtype if dtype is None else dtype
    if not x.is_floating_point() or not dtype.is_floating_point:
        raise TypeError(f"dropout needs floating tensors, got {x.dtype} -> {dtype}")
    s = dropout_scale(p)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    if x.dtype == torch.float64 and dtype != torch.float64:
        raise TypeError(f"dropout of float64 input rounds to float64 only, not {dtype}")
    if dtype == torch.float64:  # one IEEE product: rounded once
        return torch.where(kept, x.to(torch.float64) * s, zero)
    high, low = _split(s)
    wide = x.to(torch.float64)
    exact = _round_to_odd(wide * high, wide * low)  # both products exact
    finite = torch.where(wide.isfinite(), exact, wide * s)  # Inf·s, NaN as they are
    return torch.where(kept, round_once(finite, dtype), zero)
