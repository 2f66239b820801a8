#!/usr/bin/env bash
# Regenerates the Python stubs beside the .proto files (package `moe`).
# Run after changing any .proto: bash scripts/gen_protos.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m moemesh.protogen "$@"
