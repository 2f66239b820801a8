#!/usr/bin/env bash
# Sets up everything on a fresh machine, then starts the whole mesh with the
# bundled default model. Extra arguments go to `moemesh up` (e.g. --ranks 2).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bash "$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/moemesh" up "$@"
