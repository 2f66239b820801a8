# One device call that checks and measures the GPU path (docs/performance.md), on nvidia-h200-x2
# (two GPUs: N=1 and N=2 in the same call, so the speed-up compares one machine's runs).
#
#   device run, kind nvidia-h200-x2, carry [".whl"], timeout_s 600:
#       bash bench/gpu_session.sh
#   STEPS="test acc n1 n2 draws samp" (the default) picks the parts, in that order:
#     test   every tests/expert_svc/*_cuda.py: test_pipeline_cuda.py (the decode graph's inputs, launched-ahead
#            steps), test_logprobs_cuda.py (log-probabilities through the decode graphs against transformers);
#            limit 240 s (the second compiles the Triton kernels again in fp32)
#     acc    bench/kernels/attention_gpu.py --sections checks (the triton attention's bf16 accuracy)
#     attn   bench/kernels/attention_gpu.py (accuracy and speed)
#     fp8attn bench/kernels/attention_gpu.py --sections fp8decode: the float8 cache's decode kernel under other
#            launch settings beside the bf16 cache's (limit 120 s; one GPU)
#     lengths bench/kernels/attention_gpu.py --sections checks,lengths,sdpa: whole prompts at new lengths, the
#            first call's host ms exact (cuDNN builds a graph per length) against the length buckets, the warm-up;
#            then one prompt of 2-8K tokens through each of torch's fused kernels, grouped and expanded K/V
#     mixed  bench/serving/mixed_step.py (eager prefill / mixed / decode steps, attention settings)
#     parity bench/accuracy/hf_parity.py twice (40- and 1,500-token prompts): the serving model's logits against
#            transformers fp32 and bf16 on the same weights, at batches 1, 8, 50, 256 and in mixed steps
#            (one GPU is enough)
#     n1     bench/serving/gpu_speed.py, one rank: b1 and c256
#     full   bench/serving/gpu_speed.py, one rank, every case of the issue (b1, c8, c64, c256, mix, the profiled
#            decode step, transformers' generate) at 1K-in/1K-out; limit 400 s (not yet timed whole)
#     n2     bench/serving/gpu_speed.py, two ranks: c256 and c512 against n1's c256
#     si4    n2's c512 again with the gateway's --stream-interval 4
#     symm   n2 again with the experts' --ep-exchange symmetric (the symmetric-memory exchange)
#     nccl   n2 again with the experts' --ep-exchange nccl
#     push   n2 again with the experts' --ep-exchange-push (each rank writes into its peers' buffers)
#     signals n2 again with the experts' --ep-exchange-signals (push, flags instead of barrier kernels)
#     flags  tests/services/model/kernels/test_flags_cuda.py (the flag kernels on one GPU: compiled, waiting, timing out)
#     ep     bench/kernels/ep_gpu.py (the N=2 MoE layer: dispatch/combine against gather/reduce-scatter)
#     local  bench/kernels/ep_local.py --sweep on ONE GPU: one rank's kernels of the N=2 layer, its GEMM tiles
#     moe    bench/kernels/moe_large_batch.py --sweep at decode and prefill sizes (the MoE GEMM tiles)
#     samp   n1's c256 again, every request sampled (temperature 0.8, top_p 0.95, seeded)
#     draws  bench/serving/sampling_cost.py on the GPU: one step's draws, 256 rows x 151,936 tokens
#     fp8    n1's c256 again with --kv-cache-dtype fp8_e4m3 (half the KV bytes per decode step)
#     constraints bench/constraints/gpu_constraints.py on one rank (issue 26): c256 with a quarter of the
#            slots asking for the ticket JSON against its unconstrained twins over the same 40 s window,
#            b1's decode ms per token, the ticket schema's compile time, and b1 again with --jump-forward
#            (a second mesh); limit 300 s
#     goodput bench/serving/goodput.py on one rank (issue 30): the production mix as Poisson arrivals at
#            ${GOODPUT_RATES:-2,4,6,8,10,12,16} req/s, 30 s each, stopping past the knee; limit 540 s
#     pgraphs bench/serving/mixed_step.py --long-prompt 4096 --prefill-graphs 8192 (issue 30): the eager steps, then
#            each through piecewise CUDA graphs (their capture's time and memory, launch and wall ms, logits against
#            eager); tests/expert_svc/test_prefill_graphs_cuda.py first; limit 300 s (one GPU)
#     egoodput the goodput step with the experts' prefill graphs off (--prefill-graph-tokens 0, --name
#            goodput_eager), to set beside a goodput step's rates (the defaults: graphs on): run the two in
#            separate calls (each up to 540 s)
#     programs bench/programs/ticket.py --device cuda on one rank (issue 28): the ticket pipeline as an LLM
#            program against the same work as sequential Generate calls, on the demo model (the one `moemesh up`
#            serves), ${PROGRAMS_TICKETS:-100} tickets at concurrency 1 and 16; limit 420 s (one GPU is enough:
#            kind nvidia-h200, KIND=nvidia-h200)
#     step   bench/kernels/decode_variants.py at 256 sequences on one rank, then on two (--exchanges
#            ${STEP_EXCHANGES:-pull,push,signals,collectives}, 2 rounds): the 48-layer decode step replayed in a
#            CUDA graph, each rank's kernels of one eager step, the two-rank step's speed-up over one
#     vars   bench/kernels/decode_variants.py: the 48-layer decode step replayed in a CUDA graph under each
#            of $VARIANTS (module knobs; default: DECODE_VARIANTS below) at batches $VAR_BATCHES
#     quantkern tests/services/model/kernels/test_quant_kernels_cuda.py (the FP8 and AWQ kernels against their
#            torch references in bf16; limit 270 s), then bench/kernels/quant_kernels.py (each kernel's time, GB/s
#            and TFLOP/s at Qwen3-30B-A3B's shapes, M = ${QUANT_TOKENS:-1,8,64,256,4096}; limit 300 s): one GPU
#     gemvvar the batch-1 GEMV variants behind knobs (issue 29; static figures: bench/results/sass_stats_sm90.md):
#            test_quant_kernels_cuda.py -k variant (grouped AWQ, pipelined FP8; limit 150 s), then
#            bench/kernels/awq_sweep.py --cases qkv,o,moe1 (lines ending "groups": quant_awq_gemv.awq_gemv_groups)
#            (limit 240 s) and bench/kernels/fp8_moe_sweep.py --tokens 1 (plain against pipelined loops; 150 s);
#            one GPU (kind nvidia-h200, KIND=nvidia-h200)
#     quant  bench/serving/quant_speed.py (issue 29): Qwen3-30B-A3B random weights in bf16, FP8 and AWQ
#            (${QUANT_PRESETS}), one mesh each after the other: b1, c256, mix (${QUANT_CASES}), each against its
#            bandwidth bound and against bf16; ${QUANT_ARGS:-"--output-scale 0.25 --mix-requests 32"} (1K-in/256-out
#            and 32 mix requests, to fit about 5 minutes; QUANT_ARGS=" " for 1K/1K); limit 330 s (one GPU: kind
#            nvidia-h200, KIND=nvidia-h200; results are written after each preset, so a cut run keeps the first)
#     quantvar bench/serving/quant_speed.py --name quant_variants_speed with the expert services'
#            --quant-gemv-variants awq-nibbles,fp8-pipelined (--expert-arg): the FP8 and AWQ presets
#            (${QUANTVAR_PRESETS}) serving b1 (${QUANTVAR_CASES:-b1}) through the batch-1 GEMV variants, to set
#            beside the quant step's rows of the same call; limit 300 s (one GPU, kind nvidia-h200)
#     quant235 bench/serving/quant_speed.py on qwen3-235b-a22b-awq (124 GB of weights on one H200): b1, c16, c64,
#            mix (${QUANT235_CASES}), the memory plan and the KV capacity in tokens; QUANT235_ARGS as QUANT_ARGS;
#            limit 330 s (one GPU)
#     c256prof the FP8 c256 case (1K/1K, float8 KV cache) with its rank's first ${C256PROF_STEPS:-40} steps with
#            prompt tokens profiled (expert_svc/step_profile.py: drained, not pipelined; each line its launch,
#            wall and kernel ms, tokens and sequences, its costliest kernels and host ops), which told why that
#            case's prefill steps held the host (lazily loaded LM head kernels: docs/performance.md); the
#            warm-up's steps come first,
#            the case's are those of 8 prompts beside the decodes; --name quant_c256prof (its throughput
#            is the profiler's, not a result); c256prof/prof.jsonl; limit 300 s (one GPU)
#     fp8kern  bench/kernels/fp8_moe_sweep.py at ${FP8_TOKENS:-256,2048,4096,8192} tokens (the FP8 grouped MoE's tiles
#            against bf16; printed to the log; limit 200 s), then bench/kernels/quant_decode_step.py: the 48-layer
#            decode step at 64 and 256 rows, bf16 and FP8, each with its 14 costliest kernels (limit 150 s);
#            one GPU
#     quantacc tests/services/model/test_random_quant_cuda.py (the random quantized presets drawn on the GPU),
#            then bench/accuracy/hf_parity.py --quant fp8 then --quant awq on the 30B shape cut to 8 layers
#            (${QUANTACC_LAYERS}), the references on the dequantized weights; limit 240 s each
#     routing bench/accuracy/routing_agreement.py on the 30B shape (fp8 and awq against their dequantized
#            twins and the unquantized draw); limit 240 s
#   N1_ARGS / N2_ARGS / CONSTRAINTS_ARGS / PROGRAMS_ARGS add arguments to those runs (e.g. N1_ARGS="--max-batch-tokens 8192");
#   MOE_TOKENS picks the moe sweep's step sizes (default 128,256,2048,4096,8192: decode sizes and serving's prefill steps).
#
# Everything lands in $OUT/session.tgz (the device tool returns at most 8 files) plus
# $OUT/session.log, both rewritten after each part; each part runs under its own time
# limit so one hang loses one part. The default parts took about 5 of a call's 10 minutes
# in session 7 (test 16 s, acc 13 s, n1 80 s, n2 90 s, samp 54 s; draws not yet run); run
# the optional ones in a second call.
#
# GPU_SESSION_DRY=1 prints each part's command (one line, shell-quoted) instead of running it,
# with no set-up: tests/bench/test_gpu_session_paths.py parses every step's arguments on the CPU.
set -u
STEPS=${STEPS:-"test acc n1 n2 draws samp"}
OUT=${OUT:-/tmp/gpu_session_out}
RESULTS=/tmp/gpu_session
DRY=${GPU_SESSION_DRY:-0}
if [ "$DRY" != 1 ]; then
    rm -rf "$RESULTS"  # a warm machine keeps /tmp: only this call's results go back
    mkdir -p "$OUT" "$RESULTS"
fi
LOG="$OUT/session.log"
if [ "$DRY" != 1 ]; then
    source "${GPU_ENV:-bench/gpu_env.sh}" || exit 1
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >"$LOG" 2>&1
fi
# The file name gpu_speed writes for a --kind.
KIND=${KIND:-nvidia-h200-x2}  # nvidia-h200: a one-GPU call (n1 and the single-GPU parts only)

part() {  # part NAME LIMIT_S COMMAND...: runs one part, logging its time and exit status
    local name=$1 limit=$2 start rc
    shift 2
    if [ "$DRY" = 1 ]; then
        printf '%q ' "$@"
        echo
        return 0
    fi
    start=$(date +%s)
    echo "=== $name: $*" >>"$LOG"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - start )) s" >>"$LOG"
    # After every part: a call cut off at its limit still brings back the parts done.
    tar czf "$OUT/session.tgz" -C "$RESULTS" . 2>>"$LOG"
    return $rc
}

two_ranks() {  # two_ranks NAME ARGS...: gpu_speed on two ranks, c256 and c512, against n1's c256
    local name=$1
    shift
    part "$name" 240 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 2 --cases c256,c512 "$@" \
        --baseline-json "$RESULTS/n1/gpu_speed_$KIND.json" ${N2_ARGS:-} --out "$RESULTS/$name"
}

# The kernel knobs bench/kernels/decode_variants.py compares with the defaults, on one machine
# (module paths under services.model; tests/bench/kernels/test_decode_variants.py resolves each).
DECODE_VARIANTS="unfused=kernels.routing.GATE_ROUTE_ROWS_MAX_TOKENS:0,kernels.moe_grouped.FUSED_ADD_NORM:False;\
no_gate_route_rows=kernels.routing.GATE_ROUTE_ROWS_MAX_TOKENS:0;no_fused_add_norm=kernels.moe_grouped.FUSED_ADD_NORM:False;\
qkv_blocks64=kernels.rotary.QKV_ONE_TOKEN_STEPS:64;qkv_blocks32=kernels.rotary.QKV_ONE_TOKEN_STEPS:32;\
route_splits16=kernels.routing.GATE_ROUTE_ROWS_SPLITS:16;route_splits4=kernels.routing.GATE_ROUTE_ROWS_SPLITS:4;\
attn_programs8=kernels.attention.DECODE_PROGRAMS_PER_SM:8;attn_programs16=kernels.attention.DECODE_PROGRAMS_PER_SM:16"

for step in $STEPS; do
    case $step in
        test) part test 240 python3 -m pytest -q -p no:cacheprovider tests/expert_svc/*_cuda.py ;;
        parity) part parity 240 python3 -m bench.accuracy.hf_parity --mixed 64 --out "$RESULTS/parity" &&
                part parity_long 180 python3 -m bench.accuracy.hf_parity --prompt-tokens 1500 --batches 1,8 --mixed 8 \
                --out "$RESULTS/parity_long" ;;
        acc) part acc 120 python3 -m bench.kernels.attention_gpu --sections checks --out "$RESULTS/acc" ;;
        attn) part attn 240 python3 -m bench.kernels.attention_gpu --out "$RESULTS/attn" ;;
        fp8attn) part fp8attn 120 python3 -m bench.kernels.attention_gpu --sections fp8decode --out "$RESULTS/fp8attn" ;;
        lengths) part lengths 180 python3 -m bench.kernels.attention_gpu --sections checks,lengths,sdpa --out "$RESULTS/lengths" ;;
        mixed) part mixed 240 python3 -m bench.serving.mixed_step --out "$RESULTS/mixed" ;;
        n1) part n1 200 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 1 --cases b1,c256 \
                ${N1_ARGS:-} --out "$RESULTS/n1" ;;
        full) part full 400 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 1 \
                --cases b1,c8,c64,c256,mix,profile,hf ${N1_ARGS:-} --out "$RESULTS/full" ;;
        n2) two_ranks n2 ;;
        si4) part si4 200 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 2 --cases c512 \
                --gateway-arg=--stream-interval --gateway-arg=4 ${N2_ARGS:-} --out "$RESULTS/si4" ;;
        symm) two_ranks symm --expert-arg=--ep-exchange --expert-arg=symmetric ;;
        nccl) two_ranks nccl --expert-arg=--ep-exchange --expert-arg=nccl ;;
        push) two_ranks push --expert-arg=--ep-exchange-push ;;
        signals) two_ranks signals --expert-arg=--ep-exchange-signals ;;
        flags) part flags 150 python3 -m pytest -q -p no:cacheprovider tests/services/model/kernels/test_flags_cuda.py ;;
        ep) part ep 180 python3 bench/kernels/ep_gpu.py --batch-sizes 1,32,128,256 --profile-batch 128 --out "$RESULTS/ep" ;;
        local) part local 300 python3 -m bench.kernels.ep_local --rows-per-rank "${LOCAL_ROWS:-64,128,256}" --sweep \
                --out "$RESULTS/local" ;;
        moe) part moe 300 python3 bench/kernels/moe_large_batch.py --tokens "${MOE_TOKENS:-128,256,2048,4096,8192}" --sweep --out "$RESULTS/moe" ;;
        samp) part samp 200 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 1 --cases c256 --sampling 0.8,0.95 \
                ${N1_ARGS:-} --out "$RESULTS/samp" ;;
        draws) part draws 60 python3 -m bench.serving.sampling_cost --device cuda ;;
        step) part step1 150 python3 -m bench.kernels.decode_variants --batch-sizes 256 --profile --out "$RESULTS/step1" &&
              part step2 300 python3 -m bench.kernels.decode_variants --ranks 2 --batch-sizes 256 --rounds 2 --profile \
                --exchanges "${STEP_EXCHANGES:-pull,push,signals,collectives}" \
                --baseline "$RESULTS/step1/decode_variants.json" --out "$RESULTS/step2" ;;
        vars) part vars 300 python3 -m bench.kernels.decode_variants --batch-sizes "${VAR_BATCHES:-256,128,64}" \
                --variants "${VARIANTS:-$DECODE_VARIANTS}" --profile --rounds 2 --out "$RESULTS/vars" ;;
        fp8) part fp8 200 python3 -m bench.serving.gpu_speed --kind "$KIND" --ranks 1 --cases c256 \
                --expert-arg=--kv-cache-dtype --expert-arg=fp8_e4m3 ${N1_ARGS:-} --out "$RESULTS/fp8" ;;
        quantkern) part quantkern 270 python3 -m pytest -q -p no:cacheprovider \
                tests/services/model/kernels/test_quant_kernels_cuda.py
                part quantkern_bench 300 python3 -m bench.kernels.quant_kernels --tokens "${QUANT_TOKENS:-1,8,64,256,4096}" \
                --out "$RESULTS/quantkern" ;;
        gemvvar) part gemvvar_test 150 python3 -m pytest -q -p no:cacheprovider \
                tests/services/model/kernels/test_quant_kernels_cuda.py -k variant
                part gemvvar_awq 240 python3 -m bench.kernels.awq_sweep --cases qkv,o,moe1
                part gemvvar_fp8 150 python3 -m bench.kernels.fp8_moe_sweep --tokens 1 ;;
        fp8kern) part fp8kern_sweep 200 python3 -m bench.kernels.fp8_moe_sweep --tokens "${FP8_TOKENS:-256,2048,4096,8192}"
                part fp8kern_step 150 python3 -m bench.kernels.quant_decode_step --layers 48 --rows 64,256 \
                --presets qwen3-30b-a3b,qwen3-30b-a3b-fp8 --profile 14 ;;
        quant) part quant 330 python3 -m bench.serving.quant_speed --kind "$KIND" \
                --presets "${QUANT_PRESETS:-qwen3-30b-a3b,qwen3-30b-a3b-fp8,qwen3-30b-a3b-awq}" \
                --cases "${QUANT_CASES:-b1,c256,mix}" ${QUANT_ARGS:---output-scale 0.25 --mix-requests 32} \
                --out "$RESULTS/quant" ;;
        quantvar) part quantvar 300 python3 -m bench.serving.quant_speed --kind "$KIND" --name quant_variants_speed \
                --expert-arg=--quant-gemv-variants --expert-arg=awq-nibbles,fp8-pipelined \
                --presets "${QUANTVAR_PRESETS:-qwen3-30b-a3b-fp8,qwen3-30b-a3b-awq}" --cases "${QUANTVAR_CASES:-b1}" \
                --output-scale 0.25 --out "$RESULTS/quantvar" ;;
        quant235) part quant235 330 python3 -m bench.serving.quant_speed --kind "$KIND" --name quant235_speed \
                --presets qwen3-235b-a22b-awq --cases "${QUANT235_CASES:-b1,c16,c64,mix}" \
                ${QUANT235_ARGS:---output-scale 0.25 --mix-requests 32} --out "$RESULTS/quant235" ;;
        c256prof) [ "$DRY" = 1 ] || mkdir -p "$RESULTS/c256prof"
                part c256prof 300 python3 -m bench.serving.quant_speed --kind "$KIND" --name quant_c256prof \
                --presets qwen3-30b-a3b-fp8 --cases c256 --expert-arg=--kv-cache-dtype=fp8_e4m3 \
                --expert-arg=--profile-prefill-steps="${C256PROF_STEPS:-40}" --expert-arg=--profile-skip-steps=0 \
                --expert-arg=--profile-file="$RESULTS/c256prof/prof.jsonl" --out "$RESULTS/c256prof" ;;
        quantacc) part quantacc_draw 60 python3 -m pytest -q -p no:cacheprovider tests/services/model/test_random_quant_cuda.py
                part quantacc_fp8 240 python3 -m bench.accuracy.hf_parity --quant fp8 --layers "${QUANTACC_LAYERS:-8}" --batches 1,8,256 \
                --mixed 16 --out "$RESULTS/quantacc_fp8"
                part quantacc_awq 240 python3 -m bench.accuracy.hf_parity --quant awq --layers "${QUANTACC_LAYERS:-8}" --batches 1,8,256 \
                --mixed 16 --out "$RESULTS/quantacc_awq" ;;
        routing) part routing 240 python3 -m bench.accuracy.routing_agreement --preset qwen3-30b-a3b \
                --out "$RESULTS/routing" ;;
        constraints) part constraints 300 python3 -m bench.constraints.gpu_constraints --kind "$KIND" \
                ${CONSTRAINTS_ARGS:-} --out "$RESULTS/constraints" ;;
        goodput) part goodput 540 python3 -m bench.serving.goodput --kind "$KIND" --rates "${GOODPUT_RATES:-2,4,6,8,10,12,16}" \
                ${GOODPUT_ARGS:-} --out "$RESULTS/goodput" ;;
        pgraphs) part pgraphs_test 150 python3 -m pytest -q -p no:cacheprovider tests/expert_svc/test_prefill_graphs_cuda.py
                part pgraphs 300 python3 -m bench.serving.mixed_step --long-prompt 4096 --variants "" \
                --prefill-graphs 8192 --out "$RESULTS/pgraphs" ;;
        egoodput) part egoodput 540 python3 -m bench.serving.goodput --kind "$KIND" --name goodput_eager \
                --rates "${GOODPUT_RATES:-2,4,6,8,10,12,16}" --expert-arg=--prefill-graph-tokens=0 \
                ${GOODPUT_ARGS:-} --out "$RESULTS/egoodput" ;;
        programs) part programs 420 python3 -m bench.programs.ticket --device cuda \
                --num-tickets "${PROGRAMS_TICKETS:-100}" --concurrency 1,16 ${PROGRAMS_ARGS:-} --out "$RESULTS/programs" ;;
        *) echo "unknown step $step" >>"$LOG" ;;
    esac
done
[ "$DRY" = 1 ] || tail -n 60 "$LOG"
