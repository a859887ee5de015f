#!/usr/bin/env bash
# A GPU check that needs no checkpoint, in order of what it answers first: the CUDA suite
# (exactness, CUDA graphs) on tiny models, a whole decode forward's rows at each width
# (benchmarks/forward_rows.py), a decode forward's kernel time by kind and width
# (benchmarks/forward_kernels.py: exact mode, sdpa and, where FlashAttention 4 is installed, the
# flash split), the attention's price in CUDA graphs (benchmarks/exact_attention_price.py: sdpa,
# transformers' sdpa and eager functions, the Triton kernels and the flash split, per width and
# store size), then the step profile of benchmarks/gpu_steps.py on random weights of the 0.5B
# model's shape (forward ms per width, plain and tree steps with CUDA graphs, compiled and eagerly,
# through sdpa and transformers' eager attention, syncs per step). gpu_pieces.sh stops it when the
# step profile begins.
# Writes into OUT_DIR (default: benchmarks/results/gpu-quick-<date>).
#
#   bash benchmarks/gpu_quick.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${1:-benchmarks/results/gpu-quick-$(date +%Y-%m-%d)}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"
timeout "${CUDA_SUITE_SECONDS:-240}" "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/ 2>&1 \
    | tee "$out/pytest-cuda.txt"
# whether a whole decode forward gives a row the same bits at every bucket width (captured, static
# run eagerly, dynamic), and where a row parts: exact mode's premise, which its per-layer probe
# found true of every layer on an H200 while exact speculation still parted there
timeout "${ROWS_SECONDS:-60}" "$PY" benchmarks/forward_rows.py --device cuda --out "$out/forward-rows" \
    2>&1 | tail -n 12 | tee "$out/forward-rows.txt"
# where a decode forward's device time goes at each width (kernels by kind): exact mode as the
# decoder defaults to, and sdpa without it
timeout "${KERNELS_SECONDS:-60}" "$PY" benchmarks/forward_kernels.py --device cuda --out "$out/forward-kernels" \
    2>&1 | tail -n 30 | tee "$out/forward-kernels.txt"
timeout "${KERNELS_SECONDS:-60}" "$PY" benchmarks/forward_kernels.py --device cuda --exact off \
    --out "$out/forward-kernels-sdpa" 2>&1 | tail -n 30 | tee "$out/forward-kernels-sdpa.txt"
flash4=0  # whether FlashAttention 4 is installed (its import loads the CUTLASS DSL: checked once)
"$PY" -c "import flash_attn.cute" 2>/dev/null && flash4=1
if (( flash4 )); then  # and on the flash split
    timeout "${KERNELS_SECONDS:-60}" "$PY" benchmarks/forward_kernels.py --device cuda --exact off --attention flash \
        --out "$out/forward-kernels-flash" 2>&1 | tail -n 30 | tee "$out/forward-kernels-flash.txt"
fi
# the attention modes priced: transformers' own sdpa and eager functions as a decode forward calls
# them (is the tree forward's extra time sdpa's masked kernel over the whole store?), the Triton
# kernels, and the flash split where FlashAttention 4 is installed (its prefix is a dense product
# otherwise, which says nothing new)
modes=sdpa,hf-sdpa,hf-eager,triton
(( flash4 )) && modes=$modes,flash
timeout "${PRICE_SECONDS:-120}" "$PY" benchmarks/exact_attention_price.py --device cuda --modes "$modes" \
    --widths "${PRICE_WIDTHS:-1,8,32}" --capacities "${PRICE_CAPACITIES:-2048,8192}" --out "$out/exact-attention-price" \
    2>&1 | tail -n 25 | tee "$out/exact-attention-price.txt"
timeout "${STEPS_SECONDS:-300}" "$PY" benchmarks/gpu_steps.py --shapes qwen2.5-0.5b --contexts 1024 --nodes 8,32 \
    --repeats 2 --new-tokens 128 --compile --attentions eager --out "$out" 2>&1 | tee "$out/steps.txt"
