"""Explicit-vector LLVM IR for the numba kernels: every pass over a row.

The row sums (in one fixed summation order, below), the output pass, the residual add and
the backward's dx pass are ``@intrinsic`` functions that emit their loops inline where
they are called: no call per row, no array structs passed by value, and 64-byte vectors
(16 float32 or 8 float64 lanes), then a scalar tail. The elementwise passes do the same
operations in the same order in every lane, so their bits do not depend on the width
(tested against NumPy).

Every sum over a row's N elements adds them in the same order, whatever the row's dtype,
the function the sum is inlined into, LLVM's vectorizer or the CPU's vector width. The
row is cut into blocks of :data:`SUM_BLOCK` elements (the last one shorter, possibly
empty); each block is summed in the accumulation dtype by steps 1-4, the block totals
are added in float64 in block order (starting from 0), and that total is rounded once to
the accumulation dtype. Within a block of B elements:

1. ``UNROLL`` vector accumulators of ``L = lanes(dtype)`` lanes (16 for float32, 8 for
   float64: 64 bytes each), starting at 0: in step ``s`` (``L * UNROLL`` elements),
   accumulator ``u`` lane ``l`` adds element ``s * L * UNROLL + u * L + l``;
2. the whole vectors left after the last step go, in order, into accumulator 0;
3. the accumulators are added pairwise (``a0 + a1``) and the lanes halved in a tree
   (lane ``l`` plus lane ``l + L / 2``, down to one);
4. the last ``B % L`` elements are added one by one to a scalar, added last.

Numerics: a float32 lane adds at most ``SUM_BLOCK / (L * UNROLL)`` (128) terms, and the
float64 block totals lose nothing that matters, so the error of a row sum does not grow
with N (rows of 16M elements are tested). A row of at most ``SUM_BLOCK`` elements is one
block: its sum is the block's, bit for bit.

Determinism: the adds carry no fast-math flags, so LLVM keeps exactly this order (it may
still unroll or interleave, which changes no bits); functions that call these must not be
compiled with ``fastmath`` either (numba's fast-math pass flags every instruction of a
function, inlined intrinsics included). The order is part of the code: the same bits on
every path (serial or parallel, streamed or not), in every build, and on any CPU (an
accumulator is one AVX-512 register; a machine with narrower vectors splits each into
pieces, lane for lane).

Elements are loaded in their storage dtype and widened in registers to the accumulation
dtype (given by the ``zero`` argument: float32, or float64 for float64 rows): float16
and bfloat16 arrive as their 16-bit patterns (int16 and uint16 arrays, as everywhere in
these kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.core.typing import signature
from numba.extending import intrinsic

UNROLL = 2  # accumulators (independent add chains, so the adds' latency overlaps)
#: elements per block of a row sum: each block is summed in the accumulation dtype, the
#: block totals in float64 (a multiple of every ``lanes * UNROLL``)
SUM_BLOCK = 4096
_ACCUMULATOR_BYTES = 64  # one accumulator: 16 float32 or 8 float64 lanes


def lanes(acc: ir.Type) -> int:
    """Lanes per accumulator for the accumulation type ``acc`` (float or double)."""
    return _ACCUMULATOR_BYTES // (8 if isinstance(acc, ir.DoubleType) else 4)


_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def _shaped(scalar_type: ir.Type, like: ir.Value) -> ir.Type:
    """``scalar_type``, as a vector when ``like`` is one (of as many lanes)."""
    if isinstance(like.type, ir.VectorType):
        return ir.VectorType(scalar_type, like.type.count)
    return scalar_type


def widen(builder: ir.IRBuilder, raw: ir.Value, dtype: types.Type) -> ir.Value:
    """Storage values (a scalar or a vector) of numba dtype ``dtype`` in the accumulation
    dtype: float16 bits (int16) and bfloat16 bits (uint16) become float32; float32 and
    float64 stay as they are."""
    if dtype == types.int16:
        return builder.fpext(
            builder.bitcast(raw, _shaped(ir.HalfType(), raw)), _shaped(ir.FloatType(), raw)
        )
    if dtype == types.uint16:
        wide = builder.zext(raw, _shaped(_I32, raw))
        shift = _constant(_I32, 16, raw)
        return builder.bitcast(builder.shl(wide, shift), _shaped(ir.FloatType(), raw))
    return raw


def _constant(scalar_type: ir.Type, value: int, like: ir.Value) -> ir.Constant:
    """``value`` as a ``scalar_type`` constant, splat when ``like`` is a vector."""
    if isinstance(like.type, ir.VectorType):
        return ir.Constant(ir.VectorType(scalar_type, like.type.count), [value] * like.type.count)
    return ir.Constant(scalar_type, value)


def narrow(builder: ir.IRBuilder, value: ir.Value, dtype: types.Type) -> ir.Value:
    """Accumulation-dtype values (a scalar or a vector) stored as numba dtype ``dtype``:
    float16 bits by ``fptrunc`` (round to nearest even, overflow to inf, NaN kept, as
    torch does); bfloat16 bits rounded to nearest even on the bit pattern, as torch does,
    NaN becoming the quiet NaN 0x7FC0 (``c10::round_to_nearest_even``'s; torch's vectorized
    CPU conversion writes 0xFFFF); float32 and float64 as they are."""
    if dtype == types.int16:
        half = builder.fptrunc(value, _shaped(ir.HalfType(), value))
        return builder.bitcast(half, _shaped(_I16, value))
    if dtype == types.uint16:
        bits = builder.bitcast(value, _shaped(_I32, value))
        lsb = builder.and_(
            builder.lshr(bits, _constant(_I32, 16, value)), _constant(_I32, 1, value)
        )
        rounded = builder.add(builder.add(bits, _constant(_I32, 0x7FFF, value)), lsb)
        upper = builder.trunc(
            builder.lshr(rounded, _constant(_I32, 16, value)), _shaped(_I16, value)
        )
        is_nan = builder.fcmp_unordered("uno", value, value)
        return builder.select(is_nan, _constant(_I16, 0x7FC0, value), upper)
    return value


def splat(builder: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """A vector of ``lanes`` copies of the scalar ``value``."""
    vector = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, _I32(0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, lanes), [0] * lanes))


def _halve(builder: ir.IRBuilder, vector: ir.Value) -> ir.Value:
    """The tree sum of a vector's lanes: the low half plus the high half, repeatedly."""
    lanes = vector.type.count
    while lanes > 1:
        lanes //= 2
        mask = ir.VectorType(_I32, lanes)
        low = builder.shuffle_vector(vector, vector, ir.Constant(mask, list(range(lanes))))
        high = builder.shuffle_vector(
            vector, vector, ir.Constant(mask, list(range(lanes, 2 * lanes)))
        )
        vector = builder.fadd(low, high)
    return builder.extract_element(vector, _I32(0))


class Row:
    """One numba 1-D C array (a row) seen from IR: loads widen to the accumulation dtype,
    stores narrow to the row's dtype, ``lanes`` elements at a time (a vector) or one."""

    def __init__(self, context, builder: ir.IRBuilder, array_type: types.Array, value: ir.Value):
        struct = context.make_array(array_type)(context, builder, value)
        self.builder = builder
        self.data = struct.data
        self.dtype = array_type.dtype
        self.itemsize = context.get_abi_sizeof(self.data.type.pointee)
        self.length = builder.extract_value(struct.shape, 0)

    def _address(self, index: ir.Value, lanes: int) -> ir.Value:
        address = self.builder.gep(self.data, [index])
        if lanes == 1:
            return address
        return self.builder.bitcast(
            address, ir.VectorType(self.data.type.pointee, lanes).as_pointer()
        )

    def load(self, index: ir.Value, lanes: int, acc: ir.Type | None = None) -> ir.Value:
        """Elements ``index`` to ``index + lanes - 1``, widened to the row's accumulation
        dtype, or to ``acc`` (double) when given (exact: every dtype is a subset)."""
        raw = self.builder.load(self._address(index, lanes), align=self.itemsize)
        value = widen(self.builder, raw, self.dtype)
        if acc is not None and isinstance(acc, ir.DoubleType):
            scalar = value.type.element if isinstance(value.type, ir.VectorType) else value.type
            if not isinstance(scalar, ir.DoubleType):
                value = self.builder.fpext(value, _shaped(acc, value))
        return value

    def store_raw(
        self, stored: ir.Value, index: ir.Value, lanes: int, streaming: bool = False
    ) -> None:
        """Stores values already in the row's storage dtype (see :func:`narrow_once`);
        ``streaming`` as in :meth:`store` (for vectors only)."""
        streaming = streaming and lanes > 1
        align = self.itemsize * lanes if streaming else self.itemsize
        store = self.builder.store(stored, self._address(index, lanes), align=align)
        if streaming:
            store.set_metadata("nontemporal", self.builder.module.add_metadata([_I32(1)]))

    def store(self, value: ir.Value, index: ir.Value, lanes: int, streaming: bool = False) -> None:
        """``streaming``: a non-temporal store, which bypasses the cache (the address must
        then be aligned to the whole vector)."""
        self.store_raw(narrow(self.builder, value, self.dtype), index, lanes, streaming)


Terms = Callable[[ir.IRBuilder, list[ir.Value], list[ir.Value]], list[ir.Value]]


def _reduce(
    context,
    builder: ir.IRBuilder,
    arrays: Sequence[tuple[types.Array, ir.Value]],
    scalars: Sequence[ir.Value],
    terms: Terms,
    count: int,
    kept: tuple[types.Array, ir.Value] | None = None,
) -> list[ir.Value]:
    """``count`` sums over the rows ``arrays`` (numba 1-D C arrays of one length N, the
    first one's): ``terms(builder, elements, scalars)`` gives each element's ``count``
    terms from the arrays' elements (widened) and ``scalars`` (splat to match), as
    vectors of :func:`lanes` in the body and as scalars in the tail. The order is the
    module docstring's: blocks of :data:`SUM_BLOCK` elements, each summed by
    :func:`_block_sums`, their totals added in float64 in block order. With ``kept`` (a row
    of the accumulation dtype, at least N elements), ``terms`` gives one value more per element,
    stored there at the element's index (no effect on the sums)."""
    rows = [Row(context, builder, t, v) for t, v in arrays]
    keep = None if kept is None else Row(context, builder, *kept)
    n = rows[0].length
    intp = n.type
    acc = scalars[-1].type  # the zero argument's: the accumulation type
    width = lanes(acc)
    vector = ir.VectorType(acc, width)
    vector_scalars = [splat(builder, s, width) for s in scalars]
    zero_vector = ir.Constant(vector, [ir.Constant(acc, 0.0)] * width)
    sums = [
        [cgutils.alloca_once_value(builder, zero_vector) for _ in range(UNROLL)]
        for _ in range(count)
    ]
    tails = [cgutils.alloca_once_value(builder, ir.Constant(acc, 0.0)) for _ in range(count)]
    wide = ir.DoubleType()
    totals = [cgutils.alloca_once_value(builder, ir.Constant(wide, 0.0)) for _ in range(count)]

    def step(index: ir.Value, lanes: int, splat_scalars: list[ir.Value]) -> list[ir.Value]:
        values = terms(builder, [row.load(index, lanes, acc) for row in rows], splat_scalars)
        if keep is not None:
            keep.store_raw(values[count], index, lanes)
        return values[:count]

    def block(start: ir.Value, length: ir.Value) -> list[ir.Value]:
        for k in range(count):
            for u in range(UNROLL):
                builder.store(zero_vector, sums[k][u])
            builder.store(ir.Constant(acc, 0.0), tails[k])
        return _block_sums(
            builder, start, length, width, step, vector_scalars, scalars, sums, tails
        )

    def add_to_totals(values: list[ir.Value]) -> None:
        for k in range(count):
            value = values[k] if isinstance(acc, ir.DoubleType) else builder.fpext(values[k], wide)
            builder.store(builder.fadd(builder.load(totals[k]), value), totals[k])

    full = builder.udiv(n, intp(SUM_BLOCK))
    with cgutils.for_range(builder, full) as loop:  # whole blocks: constant trip counts
        add_to_totals(block(builder.mul(loop.index, intp(SUM_BLOCK)), intp(SUM_BLOCK)))
    last = builder.mul(full, intp(SUM_BLOCK))
    last_sums = block(last, builder.sub(n, last))  # the last N % SUM_BLOCK elements
    # One block (N < SUM_BLOCK): its sum as it is, which is what the float64 total would
    # round back to, without the conversions' latency on the row's critical path.
    results = [cgutils.alloca_once_value(builder, ir.Constant(acc, 0.0)) for _ in range(count)]
    with builder.if_else(builder.icmp_unsigned("==", full, intp(0))) as (one, several):
        with one:
            for k in range(count):
                builder.store(last_sums[k], results[k])
        with several:
            add_to_totals(last_sums)
            for k in range(count):
                total = builder.load(totals[k])
                if not isinstance(acc, ir.DoubleType):
                    total = builder.fptrunc(total, acc)
                builder.store(total, results[k])
    return [builder.load(r) for r in results]


def _block_sums(
    builder: ir.IRBuilder,
    start: ir.Value,
    length: ir.Value,
    width: int,
    step: Callable[[ir.Value, int, list[ir.Value]], list[ir.Value]],
    vector_scalars: list[ir.Value],
    scalars: Sequence[ir.Value],
    sums: list[list[ir.Value]],
    tails: list[ir.Value],
) -> list[ir.Value]:
    """The sums of the terms of elements ``start`` to ``start + length - 1`` in the
    accumulation dtype, steps 1-4 of the module docstring, into the zeroed accumulators
    ``sums`` (``UNROLL`` vectors per sum) and ``tails`` (a scalar per sum);
    ``step(index, lanes, scalars)`` gives the terms of ``lanes`` elements from
    ``index``."""
    intp = length.type
    count = len(sums)
    block = width * UNROLL
    blocks = builder.udiv(length, intp(block))
    with cgutils.for_range(builder, blocks) as loop:
        base = builder.add(start, builder.mul(loop.index, intp(block)))
        for u in range(UNROLL):
            values = step(builder.add(base, intp(u * width)), width, vector_scalars)
            for k in range(count):
                builder.store(builder.fadd(builder.load(sums[k][u]), values[k]), sums[k][u])
    done = builder.mul(blocks, intp(block))
    vectors = builder.udiv(builder.sub(length, done), intp(width))
    with cgutils.for_range(builder, vectors) as loop:
        index = builder.add(start, builder.add(done, builder.mul(loop.index, intp(width))))
        values = step(index, width, vector_scalars)
        for k in range(count):
            builder.store(builder.fadd(builder.load(sums[k][0]), values[k]), sums[k][0])
    tail_start = builder.add(done, builder.mul(vectors, intp(width)))
    with cgutils.for_range(builder, builder.sub(length, tail_start)) as loop:
        index = builder.add(start, builder.add(tail_start, loop.index))
        values = step(index, 1, list(scalars))
        for k in range(count):
            builder.store(builder.fadd(builder.load(tails[k]), values[k]), tails[k])
    results = []
    for k in range(count):
        a = [builder.load(s) for s in sums[k]]
        while len(a) > 1:  # pairwise: (a0 + a1) + (a2 + a3) + ...
            a = [builder.fadd(a[i], a[i + 1]) for i in range(0, len(a), 2)]
        results.append(builder.fadd(_halve(builder, a[0]), builder.load(tails[k])))
    return results


def _result(context, builder, sig, values: list[ir.Value]) -> ir.Value:
    if len(values) == 1:
        return values[0]
    return context.make_tuple(builder, sig.return_type, values)


@intrinsic
def row_sum(typingctx, z, zero):
    """``sum(z)`` in ``zero``'s dtype."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            return [values[0]]

        z, zero = args
        return _result(
            context, builder, sig, _reduce(context, builder, [(sig.args[0], z)], [zero], terms, 1)
        )

    return signature(zero, z, zero), codegen


@intrinsic
def row_sum_sq(typingctx, z, zero):
    """``sum(z * z)`` in ``zero``'s dtype."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            return [b.fmul(values[0], values[0])]

        z, zero = args
        return _result(
            context, builder, sig, _reduce(context, builder, [(sig.args[0], z)], [zero], terms, 1)
        )

    return signature(zero, z, zero), codegen


@intrinsic
def row_sums_centered(typingctx, z, m1, zero):
    """``(sum(d), sum(d * d))`` with ``d = z - m1``, in ``zero``'s dtype."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            d = b.fsub(values[0], scalars[0])
            return [d, b.fmul(d, d)]

        z, m1, zero = args
        return _result(
            context,
            builder,
            sig,
            _reduce(context, builder, [(sig.args[0], z)], [m1, zero], terms, 2),
        )

    return signature(types.UniTuple(zero, 2), z, m1, zero), codegen


@intrinsic
def row_sum_sq_kept(typingctx, z, zero, kept):
    """:func:`row_sum_sq`, also storing ``z`` widened to ``zero``'s dtype into the row
    ``kept`` (of that dtype, at least as long as ``z``): an RMSNorm row's ``d = z``, for
    :func:`normalize_row_fast_centered`."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            return [b.fmul(values[0], values[0]), values[0]]

        z, zero, kept = args
        arrays = [(sig.args[0], z)]
        sums = _reduce(context, builder, arrays, [zero], terms, 1, (sig.args[2], kept))
        return _result(context, builder, sig, sums)

    return signature(zero, z, zero, kept), codegen


@intrinsic
def row_sums_centered_kept(typingctx, z, m1, zero, kept):
    """:func:`row_sums_centered`, also storing each ``d = z - m1`` into the row ``kept``
    (``zero``'s dtype, at least as long as ``z``), for
    :func:`normalize_row_fast_centered`: the same sums, bit for bit."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            d = b.fsub(values[0], scalars[0])
            return [d, b.fmul(d, d), d]

        z, m1, zero, kept = args
        arrays = [(sig.args[0], z)]
        sums = _reduce(context, builder, arrays, [m1, zero], terms, 2, (sig.args[3], kept))
        return _result(context, builder, sig, sums)

    return signature(types.UniTuple(zero, 2), z, m1, zero, kept), codegen


@intrinsic
def row_sums_backward(typingctx, dy, x, w, mean, zero):
    """``(sum(d), sum(gh * d), sum(gh))`` with ``gh = dy * w``, ``d = x - mean``, in
    ``zero``'s dtype (``w`` is in it too)."""

    def codegen(context, builder, sig, args):
        def terms(b, values, scalars):
            g, xv, wv = values
            gh = b.fmul(g, wv)
            d = b.fsub(xv, scalars[0])
            return [d, b.fmul(gh, d), gh]

        dy, x, w, mean, zero = args
        arrays = [(sig.args[0], dy), (sig.args[1], x), (sig.args[2], w)]
        return _result(
            context, builder, sig, _reduce(context, builder, arrays, [mean, zero], terms, 3)
        )

    return signature(types.UniTuple(zero, 3), dy, x, w, mean, zero), codegen


# ---------------------------------------------------------------------------------------
# Elementwise passes: the forward's output, the backward's dx


def normalized(builder: ir.IRBuilder, z, w, b, m1, delta, rstd) -> ir.Value:
    """``((z - m1) - delta) * rstd * w + b`` (scalars or vectors alike)."""
    u = builder.fmul(builder.fsub(builder.fsub(z, m1), delta), rstd)
    return builder.fadd(builder.fmul(u, w), b)


def _elementwise(
    builder: ir.IRBuilder, n: ir.Value, width: int, element: Callable[[ir.Value, int], None]
) -> None:
    """``element(index, lanes)`` over ``range(n)``: vectors of ``width``, then one by one."""
    intp = n.type
    vectors = builder.udiv(n, intp(width))
    with cgutils.for_range(builder, vectors) as loop:
        element(builder.mul(loop.index, intp(width)), width)
    tail_start = builder.mul(vectors, intp(width))
    with cgutils.for_range(builder, builder.sub(n, tail_start)) as loop:
        element(builder.add(tail_start, loop.index), 1)


def _splat_all(builder: ir.IRBuilder, scalars: Sequence[ir.Value], lanes: int) -> list[ir.Value]:
    return list(scalars) if lanes == 1 else [splat(builder, v, lanes) for v in scalars]


@intrinsic
def normalize_row(typingctx, z, y, m1, delta, rstd, weight, bias):
    """``y = ((z - m1) - delta) * rstd * weight + bias``: the row ``z`` (its dtype)
    normalized into the row ``y`` (its dtype) with ``weight``, ``bias`` and the scalars in
    the accumulation dtype."""
    sig = signature(types.void, z, y, m1, delta, rstd, weight, bias)

    def codegen(context, builder, sig, args):
        z, y, w, b = (Row(context, builder, sig.args[k], args[k]) for k in (0, 1, 5, 6))

        def element(index: ir.Value, lanes: int) -> None:
            m1, delta, rstd = _splat_all(builder, args[2:5], lanes)
            zv, wv, bv = (row.load(index, lanes) for row in (z, w, b))
            y.store(normalized(builder, zv, wv, bv, m1, delta, rstd), index, lanes)

        _elementwise(builder, y.length, lanes(args[2].type), element)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def add_rows(typingctx, x, residual, residual_out):
    """``residual_out = x + residual`` for three rows of one dtype (added in the
    accumulation dtype)."""
    sig = signature(types.void, x, residual, residual_out)

    def codegen(context, builder, sig, args):
        x, residual, out = (
            Row(context, builder, t, v) for t, v in zip(sig.args, args, strict=True)
        )
        acc = ir.DoubleType() if sig.args[0].dtype == types.float64 else ir.FloatType()

        def element(index: ir.Value, lanes: int) -> None:
            total = builder.fadd(x.load(index, lanes), residual.load(index, lanes))
            out.store(total, index, lanes)

        _elementwise(builder, out.length, lanes(acc), element)
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------------------------------
# The backward's dx pass


def _dx_pass(context, builder, sig, args, touching: bool) -> ir.Value:
    """One row's dx and its terms of the column partial sums, element by element::

        u = ((x - mean) - delta) * rstd;  gh = dy * weight
        dx = rstd * ((gh - c2) - u * c1) + dresidual_out
        dweight_partial += dy * u;  dbias_partial += dy

    (the same operations in the same order in every lane: no reductions, so the bits do
    not depend on the vector width). ``touching``: the next row's ``dy`` and ``x`` (the
    two arrays after ``dbias_partial``) are loaded too and summed, any which way, into the value
    returned, which the caller stores so the loads stay (see ``_backward_block``)."""
    arrays = len(args) - 5
    rows = [
        Row(context, builder, t, v) for t, v in zip(sig.args[:arrays], args[:arrays], strict=True)
    ]
    dy, x, dresidual_out, dx, weight, dweight_partial, dbias_partial = rows[:7]
    scalars = args[arrays:]
    acc = scalars[0].type
    width = lanes(acc)
    touched = cgutils.alloca_once_value(
        builder, ir.Constant(ir.VectorType(acc, width), [ir.Constant(acc, 0.0)] * width)
    )

    def element(index: ir.Value, lanes: int) -> None:
        mean, delta, rstd, c1, c2 = _splat_all(builder, scalars, lanes)
        g = dy.load(index, lanes)
        u = builder.fmul(builder.fsub(builder.fsub(x.load(index, lanes), mean), delta), rstd)
        gh = builder.fmul(g, weight.load(index, lanes))
        dz = builder.fmul(rstd, builder.fsub(builder.fsub(gh, c2), builder.fmul(u, c1)))
        dx.store(builder.fadd(dz, dresidual_out.load(index, lanes)), index, lanes)
        partial = builder.fadd(dweight_partial.load(index, lanes), builder.fmul(g, u))
        dweight_partial.store(partial, index, lanes)
        dbias_partial.store(builder.fadd(dbias_partial.load(index, lanes), g), index, lanes)
        if touching and lanes > 1:
            dy_next, x_next = rows[7:]
            loaded = builder.fadd(dy_next.load(index, lanes), x_next.load(index, lanes))
            builder.store(builder.fadd(builder.load(touched), loaded), touched)

    _elementwise(builder, dx.length, width, element)
    return _halve(builder, builder.load(touched))


@intrinsic
def dx_row(
    typingctx, dy, x, dresidual_out, dx, weight, dweight_partial, dbias_partial,
    mean, delta, rstd, c1, c2,
):  # fmt: skip
    """Writes one row's ``dx`` and adds its terms to ``dweight_partial`` and
    ``dbias_partial`` (see :func:`_dx_pass`); those two, ``weight`` and the scalars are in
    the accumulation dtype, the rows in theirs."""
    sig = signature(
        types.void, dy, x, dresidual_out, dx, weight, dweight_partial, dbias_partial,
        mean, delta, rstd, c1, c2,
    )  # fmt: skip

    def codegen(context, builder, sig, args):
        _dx_pass(context, builder, sig, args, touching=False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def dx_row_touching(
    typingctx, dy, x, dresidual_out, dx, weight, dweight_partial, dbias_partial,
    dy_next, x_next, mean, delta, rstd, c1, c2,
):  # fmt: skip
    """:func:`dx_row`, also loading ``dy_next`` and ``x_next``: returns their sum."""
    sig = signature(
        mean, dy, x, dresidual_out, dx, weight, dweight_partial, dbias_partial,
        dy_next, x_next, mean, delta, rstd, c1, c2,
    )  # fmt: skip

    def codegen(context, builder, sig, args):
        return _dx_pass(context, builder, sig, args, touching=True)

    return sig, codegen


# ---------------------------------------------------------------------------------------
# Correct rounding (docs/contract.md §3): float64 arithmetic, an error bound per element,
# one rounding to the output dtype, and a flag where the bound cannot decide it


_I64 = ir.IntType(64)


def _fabs(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """``|value|`` of doubles (a scalar or a vector), by clearing the sign bit."""
    bits = builder.bitcast(value, _shaped(_I64, value))
    cleared = builder.and_(bits, _constant(_I64, (1 << 63) - 1, value))
    return builder.bitcast(cleared, value.type)


def narrow_once(builder: ir.IRBuilder, value: ir.Value, dtype: types.Type) -> ir.Value:
    """Doubles (a scalar or a vector) stored as numba dtype ``dtype``, rounded ONCE to
    nearest-even: float32 by ``fptrunc``; float16 and bfloat16 through float32 rounded to
    odd (truncate, then set the last bit when inexact), whose 13 (float16) and 16
    (bfloat16) extra bits make the second rounding, to nearest-even by :func:`narrow`,
    give the double's correct rounding (Boldo and Melquiond's round-to-odd theorem;
    bfloat16 shares float32's exponent range, so it holds for its subnormals too).
    float64 stays as it is."""
    if dtype == types.float64:
        return value
    single = builder.fptrunc(value, _shaped(ir.FloatType(), value))
    if dtype == types.float32:
        return single
    back = builder.fpext(single, value.type)
    bits = builder.bitcast(single, _shaped(_I32, value))
    away = builder.fcmp_ordered(">", _fabs(builder, back), _fabs(builder, value))
    bits = builder.select(away, builder.sub(bits, _constant(_I32, 1, value)), bits)
    inexact = builder.zext(builder.fcmp_ordered("!=", back, value), _shaped(_I32, value))
    odd = builder.bitcast(builder.or_(bits, inexact), _shaped(ir.FloatType(), value))
    return narrow(builder, odd, dtype)


class _Flags:
    """Whether a row pass left any element open: a lane per element, OR-ed over the row,
    nonzero where open; i32 lanes (i1 or i32 values ORed in) or, with ``mask``, i1 lanes
    (i1 values only: a mask register's OR, no widening per vector)."""

    def __init__(self, builder: ir.IRBuilder, width: int, mask: bool = False):
        self.builder = builder
        self.width = width
        self.element = ir.IntType(1) if mask else _I32
        self.vector = ir.VectorType(self.element, width)
        self.lanes = cgutils.alloca_once_value(builder, ir.Constant(self.vector, [0] * width))

    def add(self, differ: ir.Value) -> None:
        """ORs in ``differ`` (a vector of ``width`` lanes or a scalar)."""
        builder = self.builder
        scalar = differ.type.element if isinstance(differ.type, ir.VectorType) else differ.type
        if scalar != self.element:
            differ = builder.zext(differ, _shaped(self.element, differ))
        if not isinstance(differ.type, ir.VectorType):
            differ = builder.insert_element(
                ir.Constant(self.vector, [0] * self.width), differ, _I32(0)
            )
        builder.store(builder.or_(builder.load(self.lanes), differ), self.lanes)

    def any(self) -> ir.Value:
        """1 (i32) when any lane is nonzero, else 0."""
        vector = self.builder.load(self.lanes)
        if self.element != _I32:
            bits = self.builder.bitcast(vector, ir.IntType(self.width))
            return self.builder.zext(self.builder.icmp_unsigned("!=", bits, bits.type(0)), _I32)
        result = self.builder.extract_element(vector, _I32(0))
        for k in range(1, self.width):
            result = self.builder.or_(result, self.builder.extract_element(vector, _I32(k)))
        return self.builder.zext(self.builder.icmp_unsigned("!=", result, _I32(0)), _I32)


class _Decided:
    """Whether a row pass decided every element: an i1 lane per element, AND-ed over the
    row (:class:`_Flags` inverted: a mask register's AND per vector, which LLVM folds
    into a masked comparison with the AND of two conditions)."""

    def __init__(self, builder: ir.IRBuilder, width: int):
        self.builder = builder
        self.width = width
        self.vector = ir.VectorType(ir.IntType(1), width)
        self.lanes = cgutils.alloca_once_value(builder, ir.Constant(self.vector, [1] * width))

    def add(self, decided: ir.Value) -> None:
        """ANDs in ``decided`` (i1: a vector of ``width`` lanes, or a scalar for lane 0)."""
        builder = self.builder
        if not isinstance(decided.type, ir.VectorType):
            decided = builder.insert_element(
                ir.Constant(self.vector, [1] * self.width), decided, _I32(0)
            )
        builder.store(builder.and_(builder.load(self.lanes), decided), self.lanes)

    def any_open(self) -> ir.Value:
        """1 (i32) when some lane was not decided, else 0."""
        bits = self.builder.bitcast(self.builder.load(self.lanes), ir.IntType(self.width))
        every = ir.IntType(self.width)((1 << self.width) - 1)
        return self.builder.zext(self.builder.icmp_unsigned("!=", bits, every), _I32)


def _as_bits(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """Stored values as integers of their width (float32 bits; 16-bit ones already are)."""
    scalar = value.type.element if isinstance(value.type, ir.VectorType) else value.type
    if isinstance(scalar, ir.FloatType):
        return builder.bitcast(value, _shaped(_I32, value))
    if isinstance(scalar, ir.DoubleType):
        return builder.bitcast(value, _shaped(_I64, value))
    return value


#: A float64 pattern's low bits below float32's precision (52 - 23 fraction bits), and
#: their value at a float32 rounding boundary: the midpoint of two float32 neighbours
_SINGLE_LOW_BITS = 29
_SINGLE_MIDPOINT_BITS = 1 << (_SINGLE_LOW_BITS - 1)


def _bfloat16_boundary_within(builder: ir.IRBuilder, low: ir.Value, high: ir.Value) -> ir.Value:
    """1 (an i32 per lane) where a bfloat16 rounding boundary lies in the double interval
    ``[low, high]``, else 0: the same answer as rounding both ends to bfloat16 and
    comparing, for half the work. Every boundary ``M`` (a midpoint, the overflow
    threshold) is a float32 whose low 16 bits are 0x8000, so ``L = RN32(low) <= M <=
    H = RN32(high)`` (rounding is monotone): either ``M`` is ``L`` or ``H``, which is then
    compared with the ends in double, or ``L < M < H``, and then ``L + 0x8000`` and
    ``H + 0x8000`` differ above bit 16 (patterns grow with magnitude, subnormals
    included). Conversely ``L < M < H`` means ``low < M < high``."""
    i32 = _shaped(_I32, low)
    single = _shaped(ir.FloatType(), low)
    rounded = [builder.fptrunc(v, single) for v in (low, high)]
    ends = [builder.bitcast(r, i32) for r in rounded]
    half = _constant(_I32, 0x8000, low)
    sixteen = _constant(_I32, 16, low)
    keys = [builder.lshr(builder.add(e, half), sixteen) for e in ends]
    hit = builder.icmp_unsigned("!=", keys[0], keys[1])
    for end, r in zip(ends, rounded, strict=True):
        on = builder.icmp_unsigned("==", builder.and_(end, _constant(_I32, 0xFFFF, low)), half)
        wide = builder.fpext(r, low.type)
        inside = builder.and_(
            builder.fcmp_ordered("<=", low, wide), builder.fcmp_ordered("<=", wide, high)
        )
        hit = builder.or_(hit, builder.and_(on, inside))
    # low == high (an exact value, E = 0): one value, one rounding, nothing to decide
    hit = builder.and_(hit, builder.fcmp_unordered("!=", low, high))
    return builder.zext(hit, i32)


@intrinsic
def normalize_row_checked(typingctx, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y):
    """:func:`normalize_row` in float64 (``m1`` to ``k_y`` are doubles; ``z``, ``weight``,
    ``bias`` are widened to double exactly), each element rounded once to ``y``'s dtype
    (:func:`narrow_once`), and Ziv's rounding test on each (docs/contract.md §3)::

        d = z - m1;  c = d - delta;  p = (c * rstd) * weight;  yh = p + bias
        E = |weight| * k_w + |p| * k_p + |yh| * k_y

    ``E`` bounds ``|yh - y_exact|`` and the rounding errors of ``yh ± E`` (the caller's
    row constants make it so); it is 0 where ``p == 0`` and ``weight * k_w == 0`` (the
    value is ``bias``, and ``yh`` is it, exactly: a constant row). Returns 1 when
    ``yh - E`` and ``yh + E`` round to different values of ``y``'s dtype for some
    element (the row needs the exact fallback), else 0. For a float64 ``y`` no test is
    made (returns 0)."""
    sig = signature(types.int32, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y)

    def codegen(context, builder, sig, args):
        rows = tuple(Row(context, builder, sig.args[k], args[k]) for k in (0, 1, 5, 6))
        y = rows[1]
        flags = _Flags(builder, lanes(ir.DoubleType()))

        def element(index: ir.Value, lanes: int) -> None:
            stored, differ = _checked_values(builder, rows, args[2:5] + args[7:], index, lanes)
            y.store_raw(stored, index, lanes)
            if differ is not None:
                flags.add(differ)

        _elementwise(builder, y.length, flags.width, element)
        return flags.any()

    return sig, codegen


def _checked_values(builder: ir.IRBuilder, rows, scalars, index: ir.Value, lanes: int):
    """One vector (or element) of :func:`normalize_row_checked`: ``(stored, differ)``,
    the values to store and (i32 lanes, nonzero where open; None for float64) where
    Ziv's test leaves an element open; ``rows = (z, y, w, b)``, ``scalars = (m1, delta,
    rstd, k_w, k_p, k_y)``."""
    z, y, w, b = rows
    double = ir.DoubleType()
    m1, delta, rstd, k_w, k_p, k_y = _splat_all(builder, scalars, lanes)
    zv, wv, bv = (row.load(index, lanes, double) for row in (z, w, b))
    d = builder.fsub(zv, m1)
    c = builder.fsub(d, delta)
    p = builder.fmul(builder.fmul(c, rstd), wv)
    yh = builder.fadd(p, bv)
    stored = narrow_once(builder, yh, y.dtype)
    if y.dtype == types.float64:
        return stored, None
    mean_part = builder.fmul(_fabs(builder, wv), k_w)
    bound = builder.fadd(mean_part, builder.fmul(_fabs(builder, p), k_p))
    bound = builder.fadd(bound, builder.fmul(_fabs(builder, yh), k_y))
    # p == 0 with no error in c: the value is beta, and yh = beta exactly
    zero = ir.Constant(p.type, None)
    exact = builder.and_(
        builder.fcmp_ordered("==", p, zero), builder.fcmp_ordered("==", mean_part, zero)
    )
    bound = builder.select(exact, zero, bound)
    low, high = builder.fsub(yh, bound), builder.fadd(yh, bound)
    if y.dtype == types.uint16:
        return stored, _bfloat16_boundary_within(builder, low, high)
    low = _as_bits(builder, narrow_once(builder, low, y.dtype))
    high = _as_bits(builder, narrow_once(builder, high, y.dtype))
    return stored, builder.zext(builder.icmp_unsigned("!=", low, high), _shaped(_I32, low))


@intrinsic
def element_f64(typingctx, z, index):
    """``z[index]`` (any row dtype, 16-bit floats as their patterns) as a double, exactly."""

    def codegen(context, builder, sig, args):
        return Row(context, builder, sig.args[0], args[0]).load(args[1], 1, ir.DoubleType())

    return signature(types.float64, z, index), codegen


#: The first test's margin for 16-bit outputs (docs/contract.md §3): it passes an element
#: only where its bound is at most ``|yh| * 2^-26``, a quarter of a float32 ulp or less.
FAST_MARGIN = 2.0**-26
#: The low bits of a float32 pattern that make it a rounding boundary of a 16-bit dtype
#: (the midpoints between two of its values, the overflow threshold), and their mask:
#: bfloat16 keeps float32's top 16 bits, float16 (in its normal range) the top 19 bits.
_BOUNDARY_BITS: dict[types.Type, tuple[int, int]] = {
    types.uint16: (0x8000, 0xFFFF),
    types.int16: (0x1000, 0x1FFF),
}
#: float16's smallest normal: below it the boundaries are not at fixed low bits of a float32
_FLOAT16_NORMAL = 2.0**-14


def _splat_constant(builder: ir.IRBuilder, value: float, lanes: int) -> ir.Value:
    """The double ``value``, splat to ``lanes`` (a scalar for one)."""
    scalar = ir.Constant(ir.DoubleType(), value)
    return (
        scalar if lanes == 1 else ir.Constant(ir.VectorType(scalar.type, lanes), [scalar] * lanes)
    )


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` of doubles (scalars or vectors alike) rounded once (``llvm.fma``)."""
    kind = f"v{a.type.count}f64" if isinstance(a.type, ir.VectorType) else "f64"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.{kind}"
    )
    return builder.call(function, [a, b, c])


@intrinsic
def pattern(typingctx, value):
    """A float64's bits as an int64, or an int64's as a float64."""
    target = types.int64 if value == types.float64 else types.float64

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(target))

    return target(value), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """``a·b + c`` of doubles rounded once (``llvm.fma.f64``)."""

    def codegen(context, builder, sig, args):
        return _fma(builder, *args)

    return signature(types.float64, types.float64, types.float64, types.float64), codegen


@intrinsic
def _pointer(typingctx, address):
    """The int64 ``address`` as a ``void*``."""

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

    return types.voidptr(types.intp), codegen


@njit(inline="always")
def view(address, size, tag):  # pragma: no cover - compiled
    """The ``size`` elements of ``tag``'s dtype at ``address`` (a C entry's argument), as
    a 1-D array (no copy)."""
    return carray(_pointer(address), size, tag.dtype)


@njit(inline="always")
def two_sum(a, b):  # pragma: no cover - compiled
    """Knuth's TwoSum: ``(RN(a + b), e)`` with ``RN(a + b) + e == a + b`` exactly."""
    t = a + b
    bb = t - a
    return t, (a - (t - bb)) + (b - bb)


@njit(inline="always")
def two_prod(a, b):  # pragma: no cover - compiled
    """``(RN(a·b), e)`` with ``RN(a·b) + e == a·b`` exactly (no underflow)."""
    p = a * b
    return p, fma(a, b, -p)


def _near_boundary(builder: ir.IRBuilder, single: ir.Value, dtype: types.Type) -> ir.Value:
    """i1 (per lane) where the float32 ``single``'s pattern is within one of a ``dtype``
    rounding boundary's (:data:`_BOUNDARY_BITS`): ``(bits - (H - 1)) & mask <u 3``."""
    boundary, mask = _BOUNDARY_BITS[dtype]
    bits = builder.bitcast(single, _shaped(_I32, single))
    offset = builder.and_(
        builder.sub(bits, _constant(_I32, boundary - 1, single)), _constant(_I32, mask, single)
    )
    return builder.icmp_unsigned("<", offset, _constant(_I32, 3, single))


@intrinsic
def normalize_row_fast(
    typingctx, z, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny
):  # fmt: skip
    """The forward's first, cheap pass (docs/contract.md §3, "The cheap test first"):
    each element rounded to ``y``'s dtype, with a test that needs a two-term bound for
    float32 and no per-element bound for 16-bit outputs. Returns 1 when the test leaves
    some element open (the caller then runs :func:`normalize_row_checked`, which
    overwrites the row), else 0, and then every element stored is ``yh``'s correct
    rounding, hence (``yh`` within the bound) the exact value's.

    - float32 (:func:`_float32_values`): ``t = fma(z - m1, rstd, shift)`` (``shift =
      fl(-delta·rstd)``), ``yh = fma(t, weight, bias)``, stored ``RN32(yh)``; the
      element is decided when ``|yh| >= tiny`` and ``|yh - M| > fma(|yh|, bound_b,
      bound_a)``, ``M`` the midpoint of the two float32 neighbours of ``yh`` (the
      caller's constants make that ``E <= |yh|·FAST_MARGIN``, so ``M`` is the only
      boundary that can lie within ``E``). ``delta`` is unused.
    - bfloat16, float16: ``yh`` as in :func:`normalize_row_checked`; the caller's
      ``tiny`` is such that ``|yh| >= tiny`` implies ``E <= |yh| * FAST_MARGIN``
      (``E = 0`` at ``yh = 0`` when ``tiny = 0``); then every float32 within ``E`` of
      ``yh`` has a pattern within one of ``S = RN32(yh)``'s, so the element is decided
      unless ``|yh| < tiny`` or ``S``'s pattern is within one of a boundary's
      (:func:`_near_boundary`), or (float16) ``0 < |yh| < 2^-14``, where its
      boundaries are not at fixed float32 bits. Stored: ``RN(S)``, rounded twice, which
      is ``RN(yh)`` unless ``S`` is a boundary (tested); bfloat16 without the tie rule
      (no tie is left decided), and a NaN is left open (the checked pass writes
      :func:`narrow`'s NaN). ``shift``, ``bound_a`` and ``bound_b`` are unused.
    - float64: ``yh`` as in :func:`normalize_row_checked`, no test (returns 0).

    A NaN or infinite ``yh`` is left open for float32; a NaN passes (it stays NaN) for
    float16. ``bound_a``, ``bound_b``, ``tiny`` must not be NaN (the caller runs this
    pass only with finite weight and bias and a finite ``tiny``)."""
    sig = signature(types.int32, z, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny)
    return sig, lambda context, builder, sig, args: _fast_pass(context, builder, sig, args, False)


@intrinsic
def normalize_row_fast_streaming(
    typingctx, z, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny
):  # fmt: skip
    """:func:`normalize_row_fast` with non-temporal vector stores (no read-for-ownership
    of ``y``; same bits): ``y`` must start at a multiple of 8 elements' bytes."""
    sig = signature(types.int32, z, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny)
    return sig, lambda context, builder, sig, args: _fast_pass(context, builder, sig, args, True)


@intrinsic
def normalize_row_fast_centered(
    typingctx, d, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny
):  # fmt: skip
    """:func:`normalize_row_fast` from the row's ``d = z - m1`` (a float64 row, as
    :func:`row_sums_centered_kept` stored it; ``m1`` is unused) instead of ``z``: it
    loads each ``d`` where that pass widens ``z`` and subtracts ``m1`` again, the same
    IEEE operation on the same operands, so the same bits, with the conversion and the
    subtraction moved off the arithmetic ports onto a load."""
    sig = signature(types.int32, d, y, m1, delta, rstd, shift, weight, bias, bound_a, bound_b, tiny)
    return sig, lambda context, builder, sig, args: _fast_pass(
        context, builder, sig, args, False, centered=True
    )


def _centered(builder: ir.IRBuilder, source: Row, m1: ir.Value, index: ir.Value, lanes: int):
    """``d = z - m1`` in float64 for ``lanes`` elements from ``index``: loaded from the
    float64 row ``source`` when ``m1`` is None (it holds ``d``:
    :func:`normalize_row_fast_centered`), else computed from the row ``z = source``."""
    if m1 is None:
        return source.load(index, lanes, ir.DoubleType())
    return builder.fsub(source.load(index, lanes, ir.DoubleType()), m1)


def _float32_values(builder: ir.IRBuilder, rows, scalars, index: ir.Value, lanes: int):
    """One vector (or element) of :func:`normalize_row_fast` for a float32 ``y``:
    ``(stored, decided)``, ``decided`` an i1 per lane; ``rows = (z, y, w, b)``,
    ``scalars = (m1, rstd, shift, bound_a, bound_b, tiny)``::

        t = fma(z - m1, rstd, shift);  yh = fma(t, w, b)
        M = yh's pattern with its 29 bits below float32's precision set to 2^28
        decided where |yh| >= tiny and |yh - M| > fma(|yh|, bound_b, bound_a)

    ``M`` is the midpoint of the float32 neighbours of ``yh`` (same sign and exponent:
    ``yh - M`` is exact); a NaN or infinite ``yh`` makes ``M`` a NaN, and the ordered
    comparisons leave it open. ``m1`` None: ``rows[0]`` holds ``d = z - m1``
    (:func:`_centered`)."""
    z, _, w, b = rows
    double = ir.DoubleType()
    rstd, shift, bound_a, bound_b, tiny = _splat_all(builder, scalars[1:], lanes)
    m1 = None if scalars[0] is None else _splat_all(builder, scalars[:1], lanes)[0]
    wv, bv = (row.load(index, lanes, double) for row in (w, b))
    t = _fma(builder, _centered(builder, z, m1, index, lanes), rstd, shift)
    yh = _fma(builder, t, wv, bv)
    stored = builder.fptrunc(yh, _shaped(ir.FloatType(), yh))
    bits = builder.bitcast(yh, _shaped(_I64, yh))
    high = _constant(_I64, ~((1 << _SINGLE_LOW_BITS) - 1) & ((1 << 64) - 1), yh)
    midpoint = builder.or_(builder.and_(bits, high), _constant(_I64, _SINGLE_MIDPOINT_BITS, yh))
    distance = _fabs(builder, builder.fsub(yh, builder.bitcast(midpoint, yh.type)))
    magnitude = _fabs(builder, yh)
    bound = _fma(builder, magnitude, bound_b, bound_a)
    far = builder.fcmp_ordered(">", distance, bound)
    return stored, builder.and_(builder.fcmp_ordered(">=", magnitude, tiny), far)


def _fast_values(builder: ir.IRBuilder, rows, scalars, index: ir.Value, lanes: int):
    """One vector (or element) of :func:`normalize_row_fast` for a 16-bit or float64
    ``y``: ``(stored, open)``, the values to store (the row's storage dtype; ``rows =
    (z, y, w, b)``, ``scalars = (m1, delta, rstd, shift, bound_a, bound_b, tiny)``) and,
    but for float64, an i1 per lane where the test leaves the element open. ``m1``
    None: ``rows[0]`` holds ``d = z - m1`` (:func:`_centered`)."""
    z, y, w, b = rows
    double = ir.DoubleType()
    delta, rstd, _, _, _, tiny = _splat_all(builder, scalars[1:], lanes)
    m1 = None if scalars[0] is None else _splat_all(builder, scalars[:1], lanes)[0]
    wv, bv = (row.load(index, lanes, double) for row in (w, b))
    c = builder.fsub(_centered(builder, z, m1, index, lanes), delta)
    p = builder.fmul(builder.fmul(c, rstd), wv)
    yh = builder.fadd(p, bv)
    if y.dtype == types.float64:
        return yh, None
    single = builder.fptrunc(yh, _shaped(ir.FloatType(), yh))
    if y.dtype == types.uint16:  # no tie here (the test leaves S = boundary open)
        stored = _bfloat16_upper(builder, single)
    else:
        stored = narrow(builder, single, y.dtype)
    magnitude = _fabs(builder, yh)
    if y.dtype == types.uint16:  # a NaN too: the checked pass writes narrow's 0x7FC0
        small = builder.fcmp_unordered("<", magnitude, tiny)
    else:
        small = builder.fcmp_ordered("<", magnitude, tiny)
    if y.dtype == types.int16:  # float16's subnormals (0 itself is exact here)
        normal = ir.Constant(magnitude.type, None)
        subnormal = builder.and_(
            builder.fcmp_ordered("<", magnitude, _splat_constant(builder, _FLOAT16_NORMAL, lanes)),
            builder.fcmp_ordered("!=", magnitude, normal),
        )
        small = builder.or_(small, subnormal)
    return stored, builder.or_(small, _near_boundary(builder, single, y.dtype))


def _bfloat16_upper(builder: ir.IRBuilder, single: ir.Value) -> ir.Value:
    """float32 values rounded to bfloat16 patterns, ties away from zero (for values the
    caller has made sure are no tie: ``(bits + 0x8000) >> 16``)."""
    bits = builder.bitcast(single, _shaped(_I32, single))
    rounded = builder.lshr(
        builder.add(bits, _constant(_I32, 0x8000, bits)), _constant(_I32, 16, bits)
    )
    return builder.trunc(rounded, _shaped(_I16, bits))


def _fast_pass(context, builder, sig, args, streaming: bool, centered: bool = False) -> ir.Value:
    """:func:`normalize_row_fast`'s code (``streaming``: non-temporal vector stores;
    ``centered``: the first row holds ``d = z - m1``, :func:`normalize_row_fast_centered`)."""
    rows = tuple(Row(context, builder, sig.args[k], args[k]) for k in (0, 1, 6, 7))
    y = rows[1]
    width = lanes(ir.DoubleType())
    scalars = (None if centered else args[2], *args[3:6], *args[8:11])
    if y.dtype == types.float32:
        decided = _Decided(builder, width)
        m1, _, rstd, shift, bound_a, bound_b, tiny = scalars

        def single(index: ir.Value, lanes: int) -> None:
            scalars = (m1, rstd, shift, bound_a, bound_b, tiny)
            stored, closed = _float32_values(builder, rows, scalars, index, lanes)
            y.store_raw(stored, index, lanes, streaming)
            decided.add(closed)

        _elementwise(builder, y.length, width, single)
        return decided.any_open()
    flags = _Flags(builder, width, mask=True)  # an i1 per element

    def element(index: ir.Value, lanes: int) -> None:
        stored, differ = _fast_values(builder, rows, scalars, index, lanes)
        y.store_raw(stored, index, lanes, streaming)
        if differ is not None:
            flags.add(differ)

    _elementwise(builder, y.length, width, element)
    return flags.any()


# ---------------------------------------------------------------------------------------
# The 16-bit outputs' cheap pass in float32 lanes (docs/contract.md §3, "float32 lanes")

#: ``B32``: the relative part of the float32 lanes' bound, ``E <= A + |yh|·B32``: at
#: least ``5.01u`` (``u = 2^-24``) times ``1 + 2^-20`` for the rounding of ``E``'s fma,
#: and a float32 (81/16 u)
SINGLE_RELATIVE = 5.0625 * 2.0**-24
_F32_INF_BITS = 0x7F800000
_FLOAT16_NORMAL_BITS = 0x38800000  # 2^-14 as a float32 pattern


def _fabs32(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """``|value|`` of floats (a scalar or a vector), by clearing the sign bit."""
    bits = builder.bitcast(value, _shaped(_I32, value))
    cleared = builder.and_(bits, _constant(_I32, (1 << 31) - 1, value))
    return builder.bitcast(cleared, value.type)


def _fma32(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """``a * b + c`` of floats (scalars or vectors alike) rounded once (``llvm.fma``)."""
    kind = f"v{a.type.count}f32" if isinstance(a.type, ir.VectorType) else "f32"
    function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(a.type, [a.type] * 3), f"llvm.fma.{kind}"
    )
    return builder.call(function, [a, b, c])


def _single_values(builder: ir.IRBuilder, rows, scalars, index: ir.Value, lanes: int):
    """One vector of :func:`normalize_row_fast_single` in float32: ``(stored, open)``,
    ``open`` an i1 per lane (docs/contract.md §3)::

        d = z - m1f;  q = fma(d, r, -t);  yh = fma(q, w, b)
        E = fma(|yh|, B32, A32);  L = |yh| - E;  H = |yh| + E

    open unless ``|yh|`` is finite and no rounding boundary of ``y``'s dtype lies in
    ``[L, H]``: with ``H'`` the boundary bits (bfloat16 0x8000, float16 0x1000) and
    ``K`` the mask, the boundaries at or below a pattern ``h`` number ``(h + H') >> K``,
    so ``[L, H]`` holds one unless ``(H + H') ^ (L + H' - 1) <= K``'s mask (a negative
    ``L`` has the sign bit: open); float16 also needs ``L >= 2^-14``."""
    z, y, w, b = rows
    single = ir.FloatType()
    m1f, r, neg_t, a32 = _splat_all(builder, scalars, lanes)
    zv, wv, bv = (row.load(index, lanes) for row in (z, w, b))
    q = _fma32(builder, builder.fsub(zv, m1f), r, neg_t)
    yh = _fma32(builder, q, wv, bv)
    if y.dtype == types.uint16:
        stored = _bfloat16_upper(builder, yh)
    else:
        stored = narrow(builder, yh, y.dtype)
    magnitude = _fabs32(builder, yh)
    relative = ir.Constant(single, SINGLE_RELATIVE)
    relative = (
        relative if lanes == 1 else ir.Constant(ir.VectorType(single, lanes), [relative] * lanes)
    )
    bound = _fma32(builder, magnitude, relative, a32)
    low = builder.bitcast(builder.fsub(magnitude, bound), _shaped(_I32, yh))
    high = builder.bitcast(builder.fadd(magnitude, bound), _shaped(_I32, yh))
    boundary, mask = _BOUNDARY_BITS[y.dtype]
    keys = builder.xor(
        builder.add(high, _constant(_I32, boundary, yh)),
        builder.add(low, _constant(_I32, boundary - 1, yh)),
    )
    open_ = builder.icmp_unsigned(">", keys, _constant(_I32, mask, yh))
    infinite = _constant(_I32, _F32_INF_BITS, yh)
    finite = builder.icmp_unsigned("<", builder.bitcast(magnitude, _shaped(_I32, yh)), infinite)
    open_ = builder.or_(open_, builder.not_(finite))
    if y.dtype == types.int16:
        normal = _constant(_I32, _FLOAT16_NORMAL_BITS, yh)
        open_ = builder.or_(open_, builder.icmp_signed("<", low, normal))
    return stored, open_


@intrinsic
def normalize_row_fast_single(
    typingctx, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y, m1f, r, neg_t, a32
):  # fmt: skip
    """The output pass of a bfloat16 or float16 row (``z``, ``y``; ``weight`` and
    ``bias`` float32 or 16-bit) in float32 lanes, 16 at a time (:func:`_single_values`,
    with the float32 row constants ``m1f``, ``r``, ``neg_t``, ``a32`` of
    ``_numba_kernels._single_bounds``); a vector they leave open, and the scalar tail,
    are computed again by :func:`normalize_row_checked`'s float64 arithmetic and test
    (the constants ``m1`` to ``k_y``). Returns what :func:`normalize_row_checked` would:
    1 when its test leaves an element open, else 0; every element stored where it
    returns 0 is the correct rounding."""
    sig = signature(
        types.int32, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y, m1f, r, neg_t, a32
    )
    return sig, lambda context, builder, sig, args: _single_pass(context, builder, sig, args, False)


@intrinsic
def normalize_row_fast_single_streaming(
    typingctx, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y, m1f, r, neg_t, a32
):  # fmt: skip
    """:func:`normalize_row_fast_single` with non-temporal vector stores (no
    read-for-ownership of ``y``; same bits): ``y`` must start at a multiple of 16
    elements' bytes."""
    sig = signature(
        types.int32, z, y, m1, delta, rstd, weight, bias, k_w, k_p, k_y, m1f, r, neg_t, a32
    )
    return sig, lambda context, builder, sig, args: _single_pass(context, builder, sig, args, True)


def _single_pass(context, builder, sig, args, streaming: bool) -> ir.Value:
    """:func:`normalize_row_fast_single`'s code (``streaming``: non-temporal vector
    stores). Typed for every output dtype, run for 16-bit ones only: for the others it
    is :func:`normalize_row_checked`'s, and so for a float64 ``z`` (a 16-bit output of a
    float64 row: its float64 weight keeps it off the float32 lanes)."""
    rows = tuple(Row(context, builder, sig.args[k], args[k]) for k in (0, 1, 5, 6))
    y = rows[1]
    width = lanes(ir.FloatType())
    flags = _Flags(builder, width)
    scalars64 = args[2:5] + args[7:10]
    half = y.dtype in _BOUNDARY_BITS and rows[0].dtype != types.float64
    slot = cgutils.alloca_once(builder, ir.VectorType(_I16, width))

    def element(index: ir.Value, lanes: int) -> None:
        if lanes == 1 or not half:
            stored, differ = _checked_values(builder, rows, scalars64, index, lanes)
            y.store_raw(stored, index, lanes)
            if differ is not None:
                flags.add(differ)
            return
        stored, open_ = _single_values(builder, rows, args[10:14], index, lanes)
        builder.store(stored, slot)
        any_open = builder.icmp_unsigned(
            "!=", builder.bitcast(open_, ir.IntType(lanes)), ir.IntType(lanes)(0)
        )
        with builder.if_then(any_open, likely=False):
            again, differ = _checked_values(builder, rows, scalars64, index, lanes)
            builder.store(again, slot)
            flags.add(differ)
        y.store_raw(builder.load(slot), index, lanes, streaming)

    _elementwise(builder, y.length, width, element)
    return flags.any()
