#!/usr/bin/env bash
# Sets up everything on a fresh machine, then runs the whole test suite on the CPU.
# Extra arguments go to pytest (e.g. -k gateway).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
