#!/usr/bin/env bash
# Creates .venv and installs moemesh with its test dependencies, once.
# Re-runs the install only when pyproject.toml changes. Sourced by up.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python_bin="${MOEMESH_PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3
if [ ! -x "$venv/bin/python" ]; then
  echo "moemesh: creating $venv" >&2
  "$python_bin" -m venv "$venv"
fi
stamp="$venv/.moemesh-installed"
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "moemesh: installing dependencies into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  # torch==2.13.0 is pinned in pyproject.toml: on these machines pip takes the local CPU build.
  "$venv/bin/python" -m pip install -q -e "$root[test]" >&2
  echo "$want" > "$stamp"
fi
