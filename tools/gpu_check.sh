#!/usr/bin/env bash
# One call on a CUDA machine: versions, the GPU test suite, the demo on the
# GPU, and a small timing of the backends.  Writes logs under ${OUT:-out}/.
# Usage (from the repository root): bash tools/gpu_check.sh
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Full code generation on the device (tests/conftest.py lowers it for CPU
# compile speed unless XLA_FLAGS already sets it).
export XLA_FLAGS="--xla_backend_optimization_level=3"
PY="${PYTHON:-python3}"

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
"$PY" - <<'EOF' | tee -a "$OUT/device.txt"
import jax, flax, optax
print("jax", jax.__version__, "flax", flax.__version__, "optax",
      optax.__version__)
print("devices", jax.devices(), "backend", jax.default_backend())
import jflash
print("default order", jflash.default_order())
EOF

echo "== GPU tests"
timeout 420 "$PY" -m pytest -m gpu tests/test_gpu.py tests/test_api.py -q \
  -n "${WORKERS:-6}" -p no:cacheprovider -rfE 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

echo "== demo on the GPU"
timeout 150 "$PY" -m examples.train_lm --steps 150 --out-dir "$OUT/demo" \
  2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tee "$OUT/demo.log" | tail -25

echo "== backend timing"
timeout 120 "$PY" - <<'EOF' 2>&1 | tee "$OUT/timing.txt"
import time, jax, jax.numpy as jnp, numpy as np
import jflash
B, T, N, H = 4, 2048, 16, 128
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
           for _ in range(3))
for causal in (False, True):
  flops = 4 * B * N * T * T * H / (2 if causal else 1)
  for name, fn in [
      ("jflash default", lambda q, k, v: jflash.dot_product_attention(
          q, k, v, is_causal=causal)),
      ("jflash xla", lambda q, k, v: jflash.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla")),
      ("jax.nn xla", lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla")),
      ("jax.nn cudnn", lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn"))]:
    f = jax.jit(fn)
    jax.block_until_ready(f(q, k, v))
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      for _ in range(10):
        out = f(q, k, v)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - t0) / 10)
    ms = float(np.median(times)) * 1e3
    print(f"causal={causal} {name:15s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s")
EOF
