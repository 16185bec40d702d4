"""The ``mosaic_gpu`` kernels at benchmark-grid shapes, checked on two heads
against the float32 reference, meant to run as a child process that its
caller can time out (a kernel that deadlocks then fails one case instead
of stalling a suite).

Grid shapes (``B * S = 16384``, ``N * H = 2048``) give every CTA of the
persistent kernels many items of varying length, which small test shapes
do not.  Usage::

  python3 -m benchmarks.shape_check CASES [SEED]

``CASES`` is a JSON list of ``[head_dim, seq, causal, window, stage,
config]``: ``window`` the left window size (``local_window_size=(window,
0)``) or null, ``stage`` ``"fwd"``
(the forward alone) or ``"bwd"`` (forward and VJP), ``config``
``MosaicGpuConfig`` fields.  Per case it prints ``PHASE <name>@<s>s``
lines as it goes (inputs, compiled, ran, checked) and then ``RESULT
<json>`` with the relative errors of the output (and dQ, dK, dV) on the
first two heads (:mod:`benchmarks.check`, the grid's own check).
"""

from __future__ import annotations

import json
import sys
import time


def check_case(head_dim: int, seq: int, causal: bool, window: int | None,
               stage: str, fields: dict, rng, start: float) -> dict:
  """Runs one case; returns its result record."""
  import jax  # noqa: PLC0415 (a child process on the GPU)
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import jflash  # noqa: PLC0415
  from benchmarks import check  # noqa: PLC0415
  from benchmarks.cells import Cell  # noqa: PLC0415
  from jflash.backends.mosaic_gpu import (MosaicGpuBackend,  # noqa: PLC0415
                                          MosaicGpuConfig)

  def phase(name):
    print(f"PHASE {name}@{time.monotonic() - start:.0f}s", flush=True)

  cell = Cell(batch=16384 // seq, seq_len=seq, num_heads=2048 // head_dim,
              head_dim=head_dim, causal=causal, window=window)
  q, k, v, ct = (jnp.asarray(rng.standard_normal(
      (cell.batch, seq, cell.num_heads, head_dim), np.float32), jnp.bfloat16)
      for _ in range(4))
  backend = MosaicGpuBackend(MosaicGpuConfig(**fields))

  def attend(q, k, v):
    return jflash.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=cell.local_window_size,
        implementation=backend)

  def both(q, k, v, ct):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(ct))

  def forward(q, k, v, ct):
    del ct
    return (attend(q, k, v),)

  phase("inputs")
  run = jax.jit(both if stage == "bwd" else forward).lower(
      q, k, v, ct).compile()
  phase("compiled")
  got = jax.block_until_ready(run(q, k, v, ct))
  phase("ran")
  ref = check.reference(cell, q, k, v, None, ct, check_heads=2)
  errors = check.relative_errors(cell, got, ref, check_heads=2)
  phase("checked")
  return dict(head_dim=head_dim, seq=seq, causal=causal, window=window,
              stage=stage, fields=fields,
              errors=[errors[name] for name in check.QUANTITIES
                      if name in errors])


def main(argv: list[str]) -> None:
  import numpy as np  # noqa: PLC0415
  start = time.monotonic()
  cases = json.loads(argv[0])
  rng = np.random.default_rng(int(argv[1]) if len(argv) > 1 else 0)
  for case in cases:
    result = check_case(*case, rng=rng, start=start)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
