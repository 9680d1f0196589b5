#!/usr/bin/env bash
# One lent GPU, one call: versions, the test files that run the triton backend on the
# device, the rows each stage settles (benchmarks/gpu_open_rows.py), the host time of a
# wide float32 backward, then benchmarks/gpu_bench.py. Everything lands in $OUT (default
# /tmp/gpu-out).
#
#   TESTS_S=220 BENCH_S=180 bash tools/gpu_session.sh
#
# Runs from the repository root under the machine's own python3 and packages (its torch
# may be older than pyproject's range: the library runs from src/, not installed). Wheels
# in .whl/ (liger-kernel, for the benchmark's peer column) are installed to /tmp/site
# first. The compiled dispatch is left off (LAYERNORM_COMPILED=0): it is CPU-only.
set -u
OUT=${OUT:-/tmp/gpu-out}
TESTS_S=${TESTS_S:-220}
BENCH_S=${BENCH_S:-180}
mkdir -p "$OUT"
site=""
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && site=/tmp/site
fi
export PYTHONPATH="src${site:+:$site}" LAYERNORM_COMPILED=0 LAYERNORM_CACHE_DIR=/tmp/lncache \
    PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton, numba, numpy, sys; print(sys.version.split()[0], \
torch.__version__, triton.__version__, numba.__version__, numpy.__version__, \
torch.cuda.get_device_name())"
    nproc
} 2>&1 | tee "$OUT/versions.txt"

tests=(tests/test_triton_backend.py tests/test_triton_exact.py
    tests/test_triton_exact_backward.py tests/test_options_triton.py
    tests/test_out_dtype_triton.py tests/test_dropout_kernels.py tests/test_philox.py
    tests/test_same_bits.py tests/test_contract.py tests/test_triton_compile.py)
start=$(date +%s)
timeout "$TESTS_S" python3 -m pytest -p no:cacheprovider -p no:benchmark -q -n 8 --timeout 150 \
    --junitxml "$OUT/gpu-tests.xml" "${tests[@]}" >"$OUT/gpu-tests.txt" 2>&1
echo "tests: rc $? in $(($(date +%s) - start)) s"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -40

timeout 120 python3 benchmarks/gpu_open_rows.py >"$OUT/open_rows.md" 2>&1
echo "open rows: rc $?"
cat "$OUT/open_rows.md"

# where the host time of a wide float32 backward goes (1.45 s per 3 calls on the H200,
# benchmarks/RESULTS.md): Python's profile of one call after two warm-ups
timeout 120 python3 - >"$OUT/host_time.txt" 2>&1 <<'PY'
import cProfile, pstats, torch, layernorm
n = 262144
x = torch.randn(256, n, device="cuda", requires_grad=True)
w = torch.ones(n, device="cuda", requires_grad=True)
b = torch.zeros(n, device="cuda", requires_grad=True)
dy = torch.randn_like(x)
def call():
    layernorm.layer_norm(x, (n,), w, b, backend="triton").backward(dy)
    torch.cuda.synchronize()
call(); call()
cProfile.run("call()", "/tmp/host.prof")
pstats.Stats("/tmp/host.prof").sort_stats("tottime").print_stats(25)
PY
echo "host time: rc $?"
head -40 "$OUT/host_time.txt"

[ "$BENCH_S" -gt 0 ] || exit 0
start=$(date +%s)
timeout $((BENCH_S + 90)) python3 benchmarks/gpu_bench.py --budget-s "$BENCH_S" \
    --json "$OUT/gpu_bench.json" >"$OUT/gpu_bench.txt" 2>&1
echo "bench: rc $? in $(($(date +%s) - start)) s"
cat "$OUT/gpu_bench.txt"
