#!/bin/sh
# Prints the path of a Python >= 3.12 interpreter, or explains how to get one
# and exits 1.  Order: $PYTHON, python3.12 on PATH, python3 (if >= 3.12),
# pyenv's 3.12.x, /usr/bin/python3.12, /usr/local/bin/python3.12.
# Every candidate is actually run (pyenv shims exist even for versions that
# are not active, and then fail), so only a working interpreter is printed.

ok() {
  # ok CMD: CMD runs and is Python >= 3.12.
  [ -n "$1" ] || return 1
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' \
    >/dev/null 2>&1
}

found() {
  # Print the interpreter's real path (not a shim) and stop.
  "$1" -c 'import sys; print(sys.executable)'
  exit 0
}

if [ -n "${PYTHON:-}" ]; then
  if ok "$PYTHON"; then found "$PYTHON"; fi
  echo "error: PYTHON=$PYTHON is not a working Python >= 3.12." >&2
  exit 1
fi

for cand in python3.12 python3; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then found "$cand"; fi
done

roots=""
if command -v pyenv >/dev/null 2>&1; then roots="$(pyenv root 2>/dev/null)"; fi
roots="$roots ${PYENV_ROOT:-} $HOME/.pyenv"
for root in $roots; do
  # Newest 3.12.x first.
  for dir in $(ls -d "$root"/versions/3.12* 2>/dev/null | sort -r -V); do
    for exe in "$dir/bin/python3.12" "$dir/bin/python3"; do
      if [ -x "$exe" ] && ok "$exe"; then found "$exe"; fi
    done
  done
done

for exe in /usr/bin/python3.12 /usr/local/bin/python3.12; do
  if [ -x "$exe" ] && ok "$exe"; then found "$exe"; fi
done

cat >&2 <<'MSG'
error: no Python >= 3.12 found (JAX 0.11 needs Python 3.12 or newer).
Looked for: $PYTHON, python3.12 and python3 on PATH, pyenv's versions/3.12*,
/usr/bin/python3.12 and /usr/local/bin/python3.12.
Fix it with one of:
  - pyenv install 3.12          (then re-run make)
  - apt-get install python3.12 python3.12-venv   (distributions that ship it)
  - make PYTHON=/path/to/python3.12 test         (point at an interpreter)
MSG
exit 1
