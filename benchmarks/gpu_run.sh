#!/usr/bin/env bash
# The GPU measurement, one command: on a CUDA machine with the model and the packages in place
# (no network needed), it runs
#   1. pytest -m cuda (the GPU suite: exactness, CUDA graphs, flash against sdpa);
#   2. specdraft bench on HumanEval 10, MT-Bench 10 and the code-edit set: transformers' eager
#      generate, its static-cache compiled generate, its prompt lookup, our plain decoding and our
#      default, bfloat16, greedy;
#   3. --concurrency 1,8 on HumanEval 8;
#   4. the step profile (ms per step: forward, host, idle; plain and tree steps) of benchmarks/gpu_steps.py;
#   5. the exact attention's price in CUDA graphs (sdpa, its Triton kernels, its torch layout);
# and writes everything under benchmarks/results/gpu-<gpu>-<date>-<commit>/, whose summary.json
# files scripts/render_tables.py renders into the README's GPU rows.
#
#   bash benchmarks/gpu_run.sh                    # the default model (its cached checkpoint)
#   SPECDRAFT_MODEL=/path/to/checkpoint bash benchmarks/gpu_run.sh
#   SPECDRAFT_COMMIT=abc1234 bash benchmarks/gpu_run.sh   # where the copy has no git history
#
# About 8 minutes on an H100 or H200 for the 0.5B model (most of it the eager baselines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
model=${SPECDRAFT_MODEL:-qwen2.5-coder-0.5b}
# the GPU's model name ("NVIDIA H100 80GB HBM3" -> h100): the first word that is a letter and digits
gpu=$("$PY" -c "
import re, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else ''
words = [w for w in name.split() if re.fullmatch(r'[A-Za-z]+[0-9]+[A-Za-z]*', w)]
print((words[0] if words else name.split()[-1] if name else '').lower())")
if [[ -z "$gpu" ]]; then
    echo "gpu_run.sh: no CUDA GPU here; this script measures the GPU path" >&2
    exit 2
fi
commit=${SPECDRAFT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
out=benchmarks/results/gpu-$gpu-$(date +%Y-%m-%d)-$commit
mkdir -p "$out"
started=$(date +%s)
step() { echo "gpu_run.sh: $* ($(( $(date +%s) - started )) s in)" >&2; }

step "pytest -m cuda"
"$PY" -m pytest -m cuda -q -p no:cacheprovider 2>&1 | tee "$out/pytest-cuda.txt" || true
step "exact attention's price"
"$PY" benchmarks/exact_attention_price.py --device cuda --out "$out/exact-attention-price" || true

# the GPU's defaults (exact mode in bfloat16, Token Recycling among the sources), each beside the
# same without exact mode (its price in the same process) and the CPU's default sources
methods=baseline,generate-static,hf-prompt-lookup,plain,plain@noexact,default,default@noexact,plain@compiled,default@compiled,prompt+trie+ngram+suffix
# the flash split beside sdpa where FlashAttention 4 is installed (pip install -e '.[flash4]')
"$PY" -c "import flash_attn.cute" 2>/dev/null && methods+=,plain@flash,default@flash
step "bench: HumanEval 10, MT-Bench 10"
"$PY" -m specdraft bench --model "$model" --dtype bfloat16 --device cuda --dataset humaneval,mtbench --limit 10 \
    --methods "$methods" --out "$out/bench" --no-plot -q
step "bench: code edits"
"$PY" benchmarks/code_edit.py --jsonl "$out/code_edits.jsonl" >/dev/null
"$PY" -m specdraft bench --model "$model" --dtype bfloat16 --device cuda --dataset "$out/code_edits.jsonl" \
    --limit 6 --max-new-tokens 256 --methods "$methods" --out "$out/bench-code-edits" --no-plot -q
step "bench: concurrency 1,8"
"$PY" -m specdraft bench --model "$model" --dtype bfloat16 --device cuda --dataset humaneval --limit 8 \
    --max-new-tokens 64 --concurrency 1,8 --out "$out/concurrency" --no-plot -q
step "step profile"
"$PY" benchmarks/gpu_steps.py --shapes qwen2.5-0.5b --contexts 1024 --nodes 8,32,64 --repeats 2 --out "$out/steps"
step "done: $out"
