# one device call (removed after the session): on an H200 the MoE GEMM sweep, goodput, AWQ b1; on an H100 the sweep
export OUT
G=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "GPU: $G"
if echo "$G" | grep -q H200; then K=nvidia-h200; S=${S:-"moe goodput quant"}; else K=nvidia-h100; S=moe; fi
KIND=$K MOE_TOKENS=1024,2048,4096,8192 GOODPUT_RATES=${GOODPUT_RATES:-8,11,12} GOODPUT_ARGS="--duration-s 20" \
  QUANT_PRESETS=qwen3-30b-a3b-awq QUANT_CASES=b1 STEPS="$S" bash bench/gpu_session.sh
grep "===" $OUT/session.log
sed -n '/Every tile/,$p' /tmp/gpu_session/moe/*.md; grep -A8 "^| T | general" /tmp/gpu_session/moe/*.md
grep -A6 "^| T | block_m | best" /tmp/gpu_session/moe/*.md
grep -B2 -A8 "^| offered" /tmp/gpu_session/goodput/*.md 2>/dev/null; tail -12 /tmp/gpu_session/quant/*.md 2>/dev/null
