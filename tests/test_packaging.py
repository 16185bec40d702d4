"""The package as a user gets it: ``python -m build`` makes an sdist and,
from it, a wheel; the wheel installs into a fresh virtual environment and
``jflash.dot_product_attention`` runs there, from the installed copy rather
than the source tree.

The fresh environment gets jflash from the wheel alone (``--no-deps``, no
index); JAX and Flax come from this test environment's site-packages,
appended to the fresh environment's path by a ``.pth`` file, so that the
check needs no network and takes seconds."""

import os
import pathlib
import shutil
import site
import subprocess
import sys
import tarfile
import zipfile

import pytest

from tests._seeds import next_seed

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.packaging

# Runs in the fresh environment: the installed jflash against an exact
# float64 softmax attention in NumPy, on random inputs from the seed given.
_SMOKE = """
import sys
import numpy as np
import jax.numpy as jnp
import jflash
import jflash.flax

prefix = sys.argv[1]
assert jflash.__file__.startswith(prefix), (jflash.__file__, prefix)
rng = np.random.default_rng(int(sys.argv[2]))
B, T, N, H = 2, int(rng.integers(5, 40)), 2, 8
q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float32)
           for _ in range(3))
out = jflash.dot_product_attention(jnp.asarray(q), jnp.asarray(k),
                                   jnp.asarray(v), is_causal=True)
logits = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), k) / np.sqrt(H)
logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
p = np.exp(logits - logits.max(-1, keepdims=True))
p /= p.sum(-1, keepdims=True)
want = np.einsum("bnts,bsnh->btnh", p, v)
np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
print("jflash", jflash.__version__, "from", jflash.__file__)
"""


def _run(argv, **kwargs):
  done = subprocess.run(argv, capture_output=True, text=True, check=False,
                        **kwargs)
  assert done.returncode == 0, (argv, done.stdout[-3000:],
                                done.stderr[-3000:])
  return done


def _sources(files):
  """The package's modules, as paths below ``jflash/``."""
  return sorted(f for f in files
                if f.startswith("jflash/") and f.endswith(".py"))


def test_wheel_and_sdist_install_into_a_fresh_venv(tmp_path):
  pytest.importorskip("build", reason="the test extra installs build")
  pytest.importorskip("setuptools", reason="the test extra installs it")
  # Build from a copy, so that the source tree gets no build/ or
  # *.egg-info/ (and concurrent runs do not share them).
  src = tmp_path / "src"
  src.mkdir()
  for name in ("pyproject.toml", "README.md", "LICENSE"):
    shutil.copy(ROOT / name, src / name)
  shutil.copytree(ROOT / "jflash", src / "jflash",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  dist = tmp_path / "dist"
  _run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
        str(dist), str(src)])
  (sdist,) = dist.glob("jflash-*.tar.gz")
  (wheel,) = dist.glob("jflash-*-py3-none-any.whl")

  want = _sources(str(p.relative_to(ROOT)) for p in
                  (ROOT / "jflash").rglob("*.py"))
  with tarfile.open(sdist) as tar:
    top = tar.getnames()[0].split("/")[0]
    names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
  assert {"LICENSE", "README.md", "pyproject.toml"} <= set(names), top
  assert _sources(names) == want
  with zipfile.ZipFile(wheel) as whl:
    names = whl.namelist()
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = whl.read(info).decode()
  assert _sources(names) == want
  assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
  assert "License-Expression: Apache-2.0" in metadata
  requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines()
              if line.startswith("Requires-Dist:")]
  core = [r for r in requires if "extra ==" not in r]
  assert sorted(r.split("<")[0].split(">")[0] for r in core) == [
      "flax", "jax", "jaxlib"], core

  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = venv / "bin" / "python"
  _run([sys.executable, "-m", "pip", "--python", str(python), "install",
        "--quiet", "--no-index", "--no-deps", "--no-cache-dir", str(wheel)])
  purelib = _run([str(python), "-I", "-c",
                  "import sysconfig; print(sysconfig.get_path('purelib'))"]
                 ).stdout.strip()
  # This environment's packages go after the fresh one's own, so that
  # jflash resolves to the installed wheel.
  (pathlib.Path(purelib) / "test_environment.pth").write_text(
      "\n".join(site.getsitepackages()) + "\n")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  done = _run([str(python), "-I", "-c", _SMOKE, purelib, str(next_seed())],
              cwd=tmp_path, env=env)
  assert purelib in done.stdout
