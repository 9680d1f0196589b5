"""The dropout generator of docs/contract.md §7: Philox4x32-10 against Random123's known
answers, the torch, numba and Triton (interpreted) implementations bit for bit against
each other, batch and thread invariance, keep statistics, the keep, scaling and seed
rules, and every error."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _triton_interpreter import HAS_TRITON, import_for_the_interpreter
from layernorm.backends import _numba_philox as nphilox
from layernorm.backends import _philox as philox

import_for_the_interpreter()

#: Random123's kat_vectors, "philox4x32 10" lines: counter (4 words), key (2), output (4)
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]
#: every width of seed Triton types differently (int32, int64, uint64), and the edges
SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -1, -(2**63), 2**64 - 1]
#: (row_start, n_rows, n_cols): small; crossing 2^31 and 2^32 (the counter's high word
#: starts); near 2^62; up to the last offset 2^63 - 1
BLOCKS = [
    (0, 3, 37),
    (2**31 // 37 - 1, 3, 37),
    (2**32 // 1000 - 1, 2, 1000),
    (2**62 // 5, 2, 5),
    (2**63 - 3, 3, 1),
]
PROBABILITIES = [0.0, 0.1, 0.5, 0.9, 1.0]


def _bits(u: torch.Tensor) -> torch.Tensor:
    return u.view(torch.int32)


def _torch_uniform(seed: int, row_start: int, n_rows: int, n_cols: int) -> torch.Tensor:
    return philox.uniform(seed, philox.offsets(n_rows, n_cols, row_start))


# --- the generator ----------------------------------------------------------------------


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_philox_known_answers_torch(counter, key, expected):
    words = philox.philox4x32(tuple(torch.tensor(c) for c in counter), key)
    assert [int(w) for w in words] == list(expected)


@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_philox_known_answers_numba(counter, key, expected):
    assert [int(w) for w in nphilox.philox4x32(*counter, *key)] == list(expected)


def test_philox_torch_on_tensors_matches_numba_per_element():
    # Random counters in all four words and random keys (the offsets only reach words 0
    # and 1): the vectorized torch rounds against the scalar numba rounds.
    g = torch.Generator().manual_seed(1)
    counter = torch.randint(0, 2**32, (4, 500), dtype=torch.int64, generator=g)
    keys = torch.randint(0, 2**32, (5, 2), dtype=torch.int64, generator=g).tolist()
    for k0, k1 in keys:
        words = torch.stack(philox.philox4x32(tuple(counter), (k0, k1)))
        expected = [nphilox.philox4x32(*counter[:, j].tolist(), k0, k1) for j in range(500)]
        assert words.T.tolist() == [[int(w) for w in e] for e in expected]


def test_offsets_are_row_major_element_indices():
    off = philox.offsets(4, 6, row_start=10)
    assert off.dtype == torch.int64
    assert off.tolist() == [[r * 6 + c for c in range(6)] for r in range(10, 14)]
    assert philox.offsets(0, 5).shape == (0, 5)
    assert philox.offsets(1, 1, row_start=2**63 - 1).item() == 2**63 - 1


def test_seed_key_is_the_seed_modulo_2_64():
    assert philox.seed_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    for seed in SEEDS:
        assert philox.seed_key(seed) == philox.seed_key(seed % 2**64)
    assert philox.seed_key(-1) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert philox.seed_key(np.int64(-(2**63))) == (0, 0x80000000)


def test_offsets_zero_to_three_are_the_known_answer():
    # Offsets 0..3 take the four words of counter 0 (q = 0, stream 0): under key 0,
    # Random123's first known answer; offset 4 starts the next counter.
    off = torch.arange(8, dtype=torch.int64)
    words = philox.random_bits(0, off).tolist()
    assert words[:4] == list(KNOWN_ANSWERS[0][2])
    key = philox.seed_key(0)
    assert [int(nphilox.random_bits(*key, o)) for o in range(8)] == words
    one = torch.ones((), dtype=torch.int64)
    assert words[4:] == [int(w) for w in philox.philox4x32((one, one * 0, one * 0, one * 0), key)]
    # stream 1 is counter word 2 = 1
    zero = torch.zeros((), dtype=torch.int64)
    stream1 = [int(w) for w in philox.philox4x32((zero, zero, one, zero), key)]
    assert philox.random_bits(0, off[:4], stream=1).tolist() == stream1
    assert [int(nphilox.random_bits_of(*key, o, 1)) for o in range(4)] == stream1


def test_uniform_conversion_is_tl_rand():
    tl_rand_scale = float(np.float32(4.6566127342e-10))  # as triton/language/random.py
    assert tl_rand_scale == philox.UNIFORM_SCALE
    words = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF])
    u = philox.uniform_from_bits(words)
    top = 1 - 2**-24
    assert u.tolist() == [0.0, 2**-31 * top, top, top, 2**-31 * top, 0.0]
    # the rule, in NumPy float32: y = x or ~x as an int32, float32(y) * float32(scale)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 100_000, dtype=np.uint64)
    y = np.where(x >= 2**31, x ^ 0xFFFFFFFF, x).astype(np.float32)
    expected = y * np.float32(4.6566127342e-10)
    got = philox.uniform_from_bits(torch.from_numpy(x.astype(np.int64)))
    assert np.array_equal(got.numpy().view(np.int32), expected.view(np.int32))
    assert float(got.max()) < 1.0 and float(got.min()) >= 0.0
    numba_u = np.array([nphilox.uniform_from_bits(np.uint64(w)) for w in x[:2000]], np.float32)
    assert np.array_equal(numba_u.view(np.int32), expected[:2000].view(np.int32))


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_numba_matches_torch_bitwise(block):
    row_start, n_rows, n_cols = block
    for seed in SEEDS:
        k0, k1 = philox.seed_key(seed)
        expected = _torch_uniform(seed, row_start, n_rows, n_cols)
        got = np.empty((n_rows, n_cols), np.float32)
        for i in range(n_rows):
            nphilox.uniform_row(k0, k1, row_start + i, n_cols, got[i])
        assert torch.equal(_bits(torch.from_numpy(got)), _bits(expected))
        for p in PROBABILITIES:
            mask = np.empty((n_rows, n_cols), np.bool_)
            nphilox.keep_rows(k0, k1, row_start, philox.threshold(p), mask)
            assert torch.equal(torch.from_numpy(mask), philox.keep_from_uniform(expected, p))


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_streams_numba_match_torch_bitwise(block):
    # both mask streams (x0's and x1's of a dropout-add), per element and through
    # keep_span's four-element loop, from every alignment of a row's first offset
    row_start, n_rows, n_cols = block
    for seed in SEEDS:
        k0, k1 = philox.seed_key(seed)
        off = philox.offsets(n_rows, n_cols, row_start)
        for stream in (0, 1):
            expected = philox.random_bits(seed, off, stream=stream)
            got = [int(nphilox.random_bits_of(k0, k1, int(o), stream)) for o in off.reshape(-1)]
            assert got == expected.reshape(-1).tolist()
            for p in PROBABILITIES:
                kept = np.empty((n_rows, n_cols), np.bool_)
                for i in range(n_rows):
                    base = (row_start + i) * n_cols
                    nphilox.keep_span(k0, k1, stream, base, philox.threshold(p), kept[i])
                torch_kept = philox.keep(seed, off, p, stream=stream)
                assert torch.equal(torch.from_numpy(kept), torch_kept)


def test_keep_span_from_every_alignment_and_length():
    # the head (offsets up to a multiple of 4), the four-element body, the tail
    k0, k1 = philox.seed_key(11)
    p32 = philox.threshold(0.5)
    for base in range(8):
        for n in range(14):
            off = torch.arange(base, base + n, dtype=torch.int64)
            for stream in (0, 1):
                kept = np.empty(n, np.bool_)
                nphilox.keep_span(k0, k1, stream, base, p32, kept)
                expected = philox.keep(11, off, 0.5, stream=stream)
                assert kept.tolist() == expected.tolist(), (base, n, stream)


def test_stream_one_is_independent():
    # the chunked CPU path gives the same bits; stream 1 uncorrelated with stream 0
    off = philox.offsets(40, 1000, row_start=7)
    second = philox.random_bits(3, off, stream=1)
    assert off.numel() > philox.CPU_CHUNK
    assert torch.equal(second[:2], philox.random_bits(3, off[:2], stream=1))
    u0 = philox.uniform(3, off).double().reshape(-1)
    u1 = philox.uniform(3, off, stream=1).double().reshape(-1)
    corr = torch.corrcoef(torch.stack([u0, u1]))[0, 1].item()
    assert abs(corr) < 5 / math.sqrt(u0.numel())
    rate = philox.keep_mask(3, 40, 1000, 0.3, row_start=7, stream=1).double().mean().item()
    assert abs(rate - 0.7) < 5 * math.sqrt(0.3 * 0.7 / u0.numel())
    with pytest.raises(ValueError, match="dropout uses Philox streams 0 and 1, got stream=2"):
        philox.random_bits(3, off, stream=2)


@given(
    seed=st.integers(-(2**63), 2**64 - 1),
    row=st.integers(0, 2**40),
    n_cols=st.integers(1, 2**22),
    p=st.floats(0, 1),
)
def test_numba_matches_torch_anywhere(seed, row, n_cols, p):
    k0, k1 = philox.seed_key(seed)
    cols = torch.tensor([0, 1, n_cols // 2, n_cols - 1])
    off = row * n_cols + cols
    u = philox.uniform(seed, off)
    got = torch.tensor([nphilox.uniform(k0, k1, int(o)) for o in off], dtype=torch.float32)
    assert torch.equal(_bits(got), _bits(u))
    p32 = philox.threshold(p)
    kept = [bool(nphilox.keep(k0, k1, int(o), p32)) for o in off]
    assert kept == philox.keep(seed, off, p).tolist()


def test_batch_invariance():
    # A row's mask is a function of its global index alone: not of the rows around it,
    # nor of how many rows a call generates.
    seed, p = 2024, 0.3
    whole = philox.keep_mask(seed, 100, 129, p)
    for start, count in ((0, 1), (37, 4), (99, 1), (13, 60)):
        part = philox.keep_mask(seed, count, 129, p, row_start=start)
        assert torch.equal(part, whole[start : start + count])
    k0, k1 = philox.seed_key(seed)
    mask = np.empty((4, 129), np.bool_)
    nphilox.keep_rows(k0, k1, 37, philox.threshold(p), mask)
    assert torch.equal(torch.from_numpy(mask), whole[37:41])
    row = np.empty(129, np.bool_)
    nphilox.keep_row(k0, k1, 99, 129, philox.threshold(p), row)
    assert torch.equal(torch.from_numpy(row), whole[99])
    # a chunk of columns (a wide kernel's program) from its offsets alone
    assert torch.equal(philox.keep(seed, philox.offsets(100, 129)[:, 64:128], p), whole[:, 64:128])


def test_thread_count_invariance():
    k0, k1 = philox.seed_key(7)
    masks = []
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, saved}):
            numba.set_num_threads(threads)
            mask = np.empty((257, 300), np.bool_)
            nphilox.keep_rows(k0, k1, 5, philox.threshold(0.5), mask)
            masks.append(mask)
    finally:
        numba.set_num_threads(saved)
    assert all(np.array_equal(m, masks[0]) for m in masks)
    assert torch.equal(torch.from_numpy(masks[0]), philox.keep_mask(7, 257, 300, 0.5, 5))


def test_cpu_chunks_give_the_same_bits(monkeypatch):
    off = philox.offsets(50, 333, row_start=2**40)  # 16650 elements: two chunks
    chunked = philox.random_bits(9, off)
    strided = philox.random_bits(9, off[:, 1::3])  # a non-contiguous view, chunked
    monkeypatch.setattr(philox, "CPU_CHUNK", 10**9)
    assert torch.equal(chunked, philox.random_bits(9, off))
    assert torch.equal(strided, chunked[:, 1::3])
    monkeypatch.setattr(philox, "CPU_CHUNK", 1000)
    assert torch.equal(chunked, philox.random_bits(9, off))


def test_regenerated_mask_is_identical():
    # The backward calls the generator again with the forward's (seed, rows, p).
    first = philox.keep_mask(99, 8, 1000, 0.25)
    torch.rand(100)  # torch's generator state is not involved
    assert torch.equal(first, philox.keep_mask(99, 8, 1000, 0.25))
    assert not torch.equal(first, philox.keep_mask(100, 8, 1000, 0.25))


# --- statistics -------------------------------------------------------------------------


def _numba_mask(seed: int, p: float, shape=(1000, 1000)) -> np.ndarray:
    mask = np.empty(shape, np.bool_)
    nphilox.keep_rows(*philox.seed_key(seed), 0, philox.threshold(p), mask)
    return mask


@pytest.mark.parametrize("p", [0.01, 0.1, 0.5, 0.9, 0.99])
def test_keep_rate_is_one_minus_p(p):
    n = 10**6
    rate = _numba_mask(12345, p).mean()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)


def test_uniforms_are_uniform_and_uncorrelated():
    k0, k1 = philox.seed_key(3)
    u = np.empty((1000, 1000), np.float32)
    for i in range(1000):
        nphilox.uniform_row(k0, k1, i, 1000, u[i])
    counts = np.bincount((u.ravel() * 64).astype(np.int64), minlength=64)
    chi2 = float(((counts - 10**6 / 64) ** 2 / (10**6 / 64)).sum())
    assert chi2 < 130  # 63 degrees of freedom: P(chi2 > 130) < 1e-6
    bound = 5 / math.sqrt(u.size)
    for a, b in ((u[:, 1:], u[:, :-1]), (u[1:], u[:-1]), (u[:, 4:], u[:, :-4])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < bound
    # neighbouring seeds give unrelated masks
    other = np.empty((1, 10**5), np.float32)
    nphilox.uniform_row(*philox.seed_key(4), 0, 10**5, other[0])
    assert abs(np.corrcoef(u.ravel()[: 10**5], other[0])[0, 1]) < 5 / math.sqrt(10**5)


def test_p_zero_keeps_all_and_p_one_drops_all():
    # including the two words whose uniform is exactly 0 (u > 0 would drop them)
    zero_u = torch.zeros(3)
    assert philox.keep_from_uniform(zero_u, 0.0).all()
    assert not philox.keep_from_uniform(torch.full((3,), 1 - 2**-24), 1.0).any()
    assert philox.keep_mask(5, 300, 300, 0.0).all()
    assert not philox.keep_mask(5, 300, 300, 1.0).any()
    assert _numba_mask(5, 0.0, (300, 300)).all()
    assert not _numba_mask(5, 1.0, (300, 300)).any()
    assert nphilox.keep(0, 0, 0, np.float32(0.0))


def test_keep_rule_compares_with_float32_p():
    p = 0.1  # float32(0.1) = 0.10000000149... > 0.1
    p32 = np.float32(p)
    u = torch.tensor([float(np.nextafter(p32, np.float32(0))), float(p32), 0.1000000089])
    assert philox.keep_from_uniform(u, p).tolist() == [False, False, True]
    assert philox.threshold(p) == float(p32)


# --- Triton, interpreted -----------------------------------------------------------------


def _loaded(name: str, interpret: bool) -> ModuleType:
    """A fresh copy of module ``name`` whose ``@triton.jit`` run in Triton's interpreter
    (``interpret``) or compile for the GPU."""
    from triton import knobs

    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    return module


def _triton_interprets() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.rand, InterpretedFunction)


@pytest.fixture(scope="module")
def tphilox():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not _triton_interprets():
        pytest.skip("triton was imported compiled: run TRITON_INTERPRET=1 pytest " + __file__)
    return _loaded("layernorm.backends._triton_philox", interpret=True)


def _triton_mask(
    tphilox, seed, p, row_start, n_rows, n_cols, int32_offsets=False, block=None, device="cpu"
):
    import triton
    from triton import knobs

    # one program per row up to 1024 columns: the interpreter pays per program
    block = block or min(1024, triton.next_power_of_2(n_cols))
    keep = torch.empty(n_rows, n_cols, dtype=torch.bool, device=device)
    u = torch.empty(n_rows, n_cols, dtype=torch.float32, device=device)
    grid = (n_rows, triton.cdiv(n_cols, block))
    with knobs.runtime.scope():  # a launch in the interpreter needs it set
        knobs.runtime.interpret = device == "cpu"
        tphilox.mask_kernel[grid](
            keep, u, seed, p, row_start, n_cols, BLOCK=block, INT32_OFFSETS=int32_offsets
        )
    return keep.cpu(), u.cpu()


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_triton_matches_torch_bitwise(tphilox, block):
    row_start, n_rows, n_cols = block
    for seed in SEEDS:
        expected = _torch_uniform(seed, row_start, n_rows, n_cols)
        for p in (0.5,) if seed else PROBABILITIES:
            keep, u = _triton_mask(tphilox, seed, p, row_start, n_rows, n_cols)
            assert torch.equal(_bits(u), _bits(expected))
            assert torch.equal(keep, philox.keep_from_uniform(expected, p))


def test_triton_known_answer_and_int32_offsets(tphilox):
    # offsets 0..3 under seed 0: the first known answer's four words, through tl.philox
    _, u = _triton_mask(tphilox, 0, 0.5, 0, 1, 4)
    words = torch.tensor(KNOWN_ANSWERS[0][2]).reshape(1, 4)
    assert torch.equal(_bits(u), _bits(philox.uniform_from_bits(words)))
    # int32 offsets give the int64 offsets' bits below 2^31 (up to the last one)
    for row_start, n_rows, n_cols in ((0, 5, 100), (2**31 // 100 - 4, 4, 100)):
        narrow = _triton_mask(tphilox, 77, 0.3, row_start, n_rows, n_cols, int32_offsets=True)
        wide = _triton_mask(tphilox, 77, 0.3, row_start, n_rows, n_cols)
        assert torch.equal(narrow[0], wide[0]) and torch.equal(_bits(narrow[1]), _bits(wide[1]))
    assert (2**31 // 100) * 100 - 1 < 2**31


def test_triton_keep_rate(tphilox):
    keep, _ = _triton_mask(tphilox, 31337, 0.2, 0, 32, 1024)
    assert torch.equal(keep, philox.keep_mask(31337, 32, 1024, 0.2))
    assert abs(keep.double().mean().item() - 0.8) < 5 * math.sqrt(0.2 * 0.8 / keep.numel())


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available()), reason="needs a CUDA device and triton"
)
def test_gpu_masks_are_the_cpu_masks():
    # compiled Triton and torch on the GPU give the CPU's bits (torch's uniforms are
    # computed in CUDA kernels there: the int64 products and the float32 conversion)
    compiled = _loaded("layernorm.backends._triton_philox", interpret=False)
    for seed in SEEDS:
        for row_start, n_rows, n_cols in [*BLOCKS, (0, 64, 4099)]:
            expected = _torch_uniform(seed, row_start, n_rows, n_cols)
            on_gpu = philox.uniform(seed, philox.offsets(n_rows, n_cols, row_start, "cuda"))
            assert torch.equal(_bits(on_gpu.cpu()), _bits(expected))
            for p in (0.0, 0.3, 1.0):
                keep, u = _triton_mask(compiled, seed, p, row_start, n_rows, n_cols, device="cuda")
                assert torch.equal(_bits(u), _bits(expected))
                assert torch.equal(keep, philox.keep_from_uniform(expected, p))
    g = torch.Generator("cuda").manual_seed(3)
    assert 0 <= philox.draw_seed(g) < 2**63 - 1


#: compiles mask_kernel for sm_90 (no GPU needed) in a process where triton is compiled,
#: and prints, per variant, the PTX instructions the bits depend on
_COMPILE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layernorm.backends import _triton_philox

for seed, narrow in (("i32", False), ("i64", False), ("u64", False), ("i64", True)):
    signature = {"KEEP": "*i1", "U": "*fp32", "seed": seed, "p": "fp32", "row_start": "i64",
                 "n_cols": "i32", "BLOCK": "constexpr", "INT32_OFFSETS": "constexpr"}
    source = ASTSource(fn=_triton_philox.mask_kernel, signature=signature,
                       constexprs={(6,): 1024, (7,): narrow})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(seed, narrow, ptx.count("mul.hi.u32") > 0, ptx.count("cvt.rn.f32.s32") > 0,
          len(re.findall(r"\bfma\.", ptx)), len(re.findall(r"\bmul(\.rn)?\.f32", ptx)) > 0)
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_mask_kernel_compiles_for_sm90_with_the_interpreters_arithmetic():
    # What the GPU cannot be asked here: the compiled kernel's uniform is the interpreter's,
    # float32(y) rounded to nearest (cvt.rn) times the scale (mul, no fma to contract).
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # fusion on, as users run it: still no fma
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "i32 False True True 0 True",
        "i64 False True True 0 True",
        "u64 False True True 0 True",
        "i64 True True True 0 True",
    ]


# --- the scaling rule ---------------------------------------------------------------------


def _nearest(q: Fraction, dtype: torch.dtype) -> float:
    """The exact rational ``q`` rounded once to nearest-even in ``dtype`` (IEEE: past
    the largest finite value by half a unit or more it is Inf)."""
    fmt = torch.finfo(dtype)
    digits = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}[dtype]
    if q == 0:
        return 0.0
    e = max(math.floor(math.log2(abs(q))), math.log2(fmt.tiny)) - (digits - 1)
    unit = Fraction(2) ** int(e)
    steps = q / unit
    n = math.floor(steps)
    rest = steps - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2 == 1):
        n += 1
    value = float(n * unit)
    return math.copysign(math.inf, value) if abs(value) > fmt.max else value


def _random_values(dtype: torch.dtype, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(8)
    signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    top = 10 if dtype == torch.float16 else 20  # float16: normal numbers, no overflow
    scales = 2.0 ** torch.randint(-top, top, (n,), generator=g).double()
    return (signs * torch.rand(n, generator=g, dtype=torch.float64) * scales).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("p", [0.1, 1 / 3, 0.3, 0.9, 0.999])
def test_scaling_is_the_exact_product_rounded_once(dtype, p):
    x = _random_values(dtype, 600)
    kept = torch.ones(x.shape, dtype=torch.bool)
    got = philox.apply_dropout(x, kept, p).double().tolist()
    s = Fraction(philox.dropout_scale(p))
    assert philox.dropout_scale(p) == 1.0 / (1.0 - p)
    expected = [_nearest(Fraction(v) * s, dtype) for v in x.double().tolist()]
    assert got == expected


def test_scaling_rounds_once_where_float64_would_round_twice():
    # 3 · s with s = RN64((1 + 2^-24) / 3 · 4) / 4 ... lands within 2^-53 of the float32
    # midpoint 1 + 2^-24: rounded to float64 first it ties to 1.0, exactly it rounds up.
    x = torch.tensor([0.75])
    target = Fraction(1) + Fraction(1, 2**24)
    for p_candidate in np.arange(-40, 41) * 2.0**-54 + (1 - 3 / (4 * float(target))):
        p = float(p_candidate)
        s = philox.dropout_scale(p)
        exact = Fraction(0.75) * Fraction(s)
        twice = float(np.float32(0.75 * s))
        once = _nearest(exact, torch.float32)
        if once != twice:
            break
    else:
        pytest.fail("no double-rounding case found near the midpoint")
    got = philox.apply_dropout(x, torch.tensor([True]), p).item()
    assert got == once == 1 + 2**-23
    assert twice == 1.0


def test_scaling_edges():
    x = torch.tensor([1.5, -2.0, float("inf"), float("nan"), -0.0, 3e38], dtype=torch.float32)
    kept = torch.tensor([True, True, True, True, True, True])
    out = philox.apply_dropout(x, kept, 0.75)  # s = 4: exactly 4x, overflow to inf
    assert out[:3].tolist() == [6.0, -8.0, math.inf] and out[3].isnan()
    assert out[4].item() == 0.0 and math.copysign(1, out[4].item()) == -1
    assert out[5].item() == math.inf
    dropped = philox.apply_dropout(x, ~kept, 0.75)  # +0.0, whatever was dropped
    assert dropped.tolist() == [0.0] * 6 and not torch.signbit(dropped).any()
    assert philox.dropout_scale(0.0) == 1.0 and philox.dropout_scale(1.0) == 0.0
    assert philox.dropout_scale(0.5) == 2.0
    assert philox.apply_dropout(x[:2], kept[:2], 1.0).tolist() == [0.0, -0.0]
    # float64 in: one IEEE product; bfloat16 in, float32 out (a residual kept in float32)
    x64 = torch.tensor([0.1, -3.0], dtype=torch.float64)
    assert philox.apply_dropout(x64, kept[:2], 0.3).tolist() == [0.1 / 0.7, -3.0 / 0.7]
    half = torch.tensor([0.1], dtype=torch.bfloat16)
    wide = philox.apply_dropout(half, kept[:1], 0.3, torch.float32)
    expected = _nearest(Fraction(half.item()) * Fraction(1 / 0.7), torch.float32)
    assert wide.dtype == torch.float32 and wide.item() == expected
    assert philox.apply_dropout(half, kept[:1], 0.3, torch.float64).item() == half.item() / 0.7


@pytest.mark.parametrize(("p", "low", "high"), [(0.1, 0.25, 0.4), (0.5, 0.0, 0.0), (0.9, 1.0, 1.0)])
def test_flash_attn_float32_scaling_is_not_rounded_once(p, low, high):
    # why the rule: x / (1.0 - p) in float32 (p and 1 - p rounded to float32) misses the
    # rounded-once product on a third of the values at p = 0.1 and on all at p = 0.9,
    # where float32(1 - float32(0.9)) is 2.4e-7 (relative) away from 0.1
    x = _random_values(torch.float32, 2000)
    one_minus = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(p, dtype=torch.float32)
    flash = x / one_minus
    ours = philox.apply_dropout(x, torch.ones(2000, dtype=torch.bool), p)
    assert low <= (flash != ours).double().mean().item() <= high


# --- seeds ---------------------------------------------------------------------------------


def test_seed_is_drawn_from_torchs_default_generator():
    torch.manual_seed(7)
    seed = philox.draw_seed()
    torch.manual_seed(7)
    assert seed == int(torch.randint(2**63 - 1, (), dtype=torch.int64))
    torch.manual_seed(7)
    assert philox.draw_seed() == seed  # manual_seed reproduces it
    assert philox.draw_seed() != seed  # and the next call draws another
    assert 0 <= seed < 2**63 - 1
    g = torch.Generator().manual_seed(7)
    assert philox.draw_seed(g) == seed


def test_manual_seed_reproduces_the_mask():
    torch.manual_seed(11)
    first = philox.keep_mask(philox.draw_seed(), 16, 64, 0.5)
    torch.manual_seed(11)
    again = philox.keep_mask(philox.draw_seed(), 16, 64, 0.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, philox.keep_mask(philox.draw_seed(), 16, 64, 0.5))


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), float("inf")])
def test_bad_probability_raises_torchs_message(p):
    with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1") as ours:
        philox.check_p(p)
    if not math.isnan(p):
        with pytest.raises(ValueError) as theirs:
            torch.nn.functional.dropout(torch.ones(2), p)
        assert str(ours.value) == str(theirs.value)
    for call in (
        lambda: philox.keep_mask(0, 2, 2, p),
        lambda: philox.dropout_scale(p),
        lambda: philox.threshold(p),
        lambda: philox.apply_dropout(torch.ones(2), torch.ones(2, dtype=torch.bool), p),
    ):
        with pytest.raises(ValueError, match="dropout probability has to be between 0 and 1"):
            call()


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="dropout probability must be a float, got str"):
        philox.check_p("0.5")
    with pytest.raises(TypeError, match="dropout probability must be a float, got bool"):
        philox.check_p(True)
    with pytest.raises(TypeError, match="dropout seed must be an int, got float"):
        philox.seed_key(1.0)
    with pytest.raises(TypeError, match="dropout seed must be an int, got bool"):
        philox.seed_key(False)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match=r"dropout seed must be in \[-2\*\*63, 2\*\*64 - 1\]"):
            philox.uniform(seed, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="dropout offsets need non-negative sizes and rows"):
        philox.offsets(2, 3, row_start=-1)
    with pytest.raises(ValueError, match=r"dropout offsets past 2\*\*63 - 1: rows up to 2 of"):
        philox.offsets(1, 2**62 + 1, row_start=1)
    with pytest.raises(
        TypeError, match=r"dropout offsets must be an int64 tensor, got torch\.int32"
    ):
        philox.random_bits(0, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout offsets must be non-negative"):
        philox.keep(0, torch.tensor([3, -1]), 0.5)
    with pytest.raises(TypeError, match=r"dropout needs floating tensors, got torch\.int64"):
        philox.apply_dropout(torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool), 0.5)
    with pytest.raises(TypeError, match="dropout of float64 input rounds to float64 only"):
        philox.apply_dropout(
            torch.ones(2, dtype=torch.float64), torch.ones(2) > 0, 0.5, torch.float32
        )
