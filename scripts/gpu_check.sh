#!/usr/bin/env bash
# GPU checks in one go, for a CUDA machine whose image already has torch, triton and transformers
# (installs nothing): the GPU tests, the kernel benchmark, the engine's tests on the GPU and the
# throughput benchmark on random weights of the real model shapes (no checkpoint needed).
#
#   OUT=/tmp/gpu-out TOKENIZER=.gpu/smollm2-tokenizer bash scripts/gpu_check.sh [BUDGET_SECONDS]
#
# TOKENIZER: a model directory holding the default model's tokenizer (config.json + tokenizer files);
# without it the default model must be installed. Each step gets what is left of the budget (default
# 540 s) and its own cap, so a slow step cannot starve the rest of their log. Results land in $OUT:
# run.log (everything, the throughput results as JSON too), gpu_tests.log, engine_tests.log,
# kernels.json and benchmarks/ (docs/benchmarks/ with the pages these runs wrote). ONLY="step names" runs
# just those steps (info gpu-tests kernels-bench throughput-smollm2 engine-tests throughput-llama8b).
set -u
OUT=${OUT:?set OUT to a results directory}
mkdir -p "$OUT"
BUDGET=${1:-540}
START=$(date +%s)
PY=${PYTHON:-python3}
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Not installed here: the floors' import names (agentrt.engine, agentrt.bench, ...) from their folders.
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${TOKENIZER:-}" ]; then
    TOKENIZER=$(cd "$TOKENIZER" && pwd)
    export AGENTRT_TEST_TOKENIZER=$TOKENIZER
    TOK_ARG="--tokenizer $TOKENIZER"
else
    TOK_ARG=""
fi

step() {  # step NAME CAP_SECONDS COMMAND...
    local name=$1 cap=$2
    shift 2
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((BUDGET - ($(date +%s) - START) - 5))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -le 10 ]; then
        echo "=== $name: skipped, budget spent" | tee -a "$OUT/run.log"
        return
    fi
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/run.log"
    local t0=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee -a "$OUT/run.log"
    echo "=== $name: rc ${PIPESTATUS[0]} in $(($(date +%s) - t0))s" | tee -a "$OUT/run.log"
}

step info 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; \
    $PY -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())'"
step gpu-tests 150 bash -c "$PY -m pytest -q -p no:cacheprovider -n 4 tests/gpu > '$OUT/gpu_tests.log' 2>&1; rc=\$?; tail -40 '$OUT/gpu_tests.log'; exit \$rc"
step kernels-bench 150 $PY -m agentrt.bench.kernels --sweep --out "$OUT/kernels.json"
step throughput-smollm2 120 $PY -m agentrt.bench.throughput --random-weights smollm2-135m $TOK_ARG --hf-batch-sizes 64 \
    --single-requests 1 --check-requests 4 --speculative 0 --kv-cache-gb 8 --json
step engine-tests 120 bash -c "AGENTRT_DTYPE=float32 $PY -m pytest -q -p no:cacheprovider tests/engine > '$OUT/engine_tests.log' 2>&1; rc=\$?; tail -40 '$OUT/engine_tests.log'; exit \$rc"
step throughput-llama8b 200 $PY -m agentrt.bench.throughput --random-weights llama-3.1-8b $TOK_ARG --hf-batch-sizes 64 \
    --single-requests 0 --speculative 0 --kv-cache-gb 24 --check-requests 4 --check-tokens 16 --json
cp -r docs/benchmarks "$OUT/benchmarks"
echo "=== done in $(($(date +%s) - START))s" | tee -a "$OUT/run.log"
