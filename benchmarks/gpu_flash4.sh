#!/usr/bin/env bash
# FlashAttention 4 on a CUDA machine that cannot download: its wheels (about 110 MB with their
# dependencies) travel in pieces small enough for calls that carry a few tens of MB each, then
# the flash checks run there.
#
# Here, with the package registry reachable:
#   bash benchmarks/gpu_flash4.sh download   # the wheels for the GPU machine's Python (PY_VERSION,
#                                            # default 3.12) into .fa4_wheels/
#   bash benchmarks/gpu_flash4.sh split      # .fa4_wheels/ as one tar in 40 MiB pieces: .fa4_parts/
# There, one call per piece (each carrying one file of .fa4_parts/), then the checks:
#   bash benchmarks/gpu_flash4.sh add        # the pieces this call carries kept in $KEEP
#   bash benchmarks/gpu_flash4.sh install    # the pieces assembled and installed into $KEEP/site
#                                            # (gpu_pieces.sh start does this when pieces were added)
#   bash benchmarks/gpu_flash4.sh check      # install, then:
#     - pytest -m cuda -k flash: FlashAttention 4's variable-length call against the dense product,
#       and decoding on it in CUDA graphs, alone and batched, against sdpa;
#     - the attention price (benchmarks/exact_attention_price.py) with the flash split beside sdpa
#       and the exact attention, per width and store size, in CUDA graphs.
# Results land in $OUT (or $KEEP/out): pytest-flash.txt, flash-price/, flash-env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
KEEP=${KEEP:-/tmp/specdraft-gpu}
WHEELS=${WHEELS:-.fa4_wheels}
PARTS=${FA4_PARTS:-.fa4_parts}
# the cutlass DSL puts its packages on the path through a .pth file, which --target installs do not run
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$KEEP/site:$KEEP/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"

# package to import -> wheels that provide it (installed only where the import fails)
declare -A PROVIDES=(
    [flash_attn.cute]="flash_attn_4-*.whl"
    [cutlass]="nvidia_cutlass_dsl-*.whl nvidia_cutlass_dsl_libs_base-*.whl nvidia_cutlass_dsl_libs_core-*.whl nvidia_cutlass_dsl_libs_cu13-*.whl"
    [quack]="quack_kernels-*.whl"
    [tvm_ffi]="apache_tvm_ffi-*.whl"
    [torch_c_dlpack_ext]="torch_c_dlpack_ext-*.whl"
    [einops]="einops-*.whl"
    [google.protobuf]="protobuf-*.whl"
    [cuda.bindings]="cuda_bindings-*.whl"
    [cuda.pathfinder]="cuda_pathfinder-*.whl"
)

case "${1:-}" in
download)
    mkdir -p "$WHEELS"
    "$PY" -m pip download -q --no-deps --pre -d "$WHEELS" --python-version "${PY_VERSION:-3.12}" --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
        --platform any "flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1" \
        "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "quack-kernels==0.6.5" \
        "apache-tvm-ffi==0.1.15.post2" "torch-c-dlpack-ext==0.1.5" "cuda-bindings>=13,<14"
    "$PY" -m pip download -q --no-deps -d "$WHEELS" --python-version "${PY_VERSION:-3.12}" --only-binary=:all: \
        --platform manylinux2014_x86_64 --platform any "einops>=0.8" "protobuf>=4.21.12,<8" "cuda-pathfinder>=1.1"
    ls -la "$WHEELS"
    ;;
split)
    rm -rf "$PARTS" && mkdir -p "$PARTS"
    tar cf - -C "$WHEELS" . | split -b 40M -d - "$PARTS/fa4.tar.part"
    ls -la "$PARTS"
    ;;
add)
    mkdir -p "$KEEP/fa4parts"
    if compgen -G "$PARTS/fa4.tar.part*" >/dev/null; then cp "$PARTS"/fa4.tar.part* "$KEEP/fa4parts/"; fi
    ls "$KEEP/fa4parts"
    ;;
install|check)
    out=${OUT:-$KEEP/out}
    mkdir -p "$out" "$KEEP/fa4wheels" "$KEEP/site" "$KEEP/fa4parts"
    if compgen -G "$PARTS/fa4.tar.part*" >/dev/null; then cp "$PARTS"/fa4.tar.part* "$KEEP/fa4parts/" 2>/dev/null; fi
    cat $(ls "$KEEP"/fa4parts/fa4.tar.part* | sort) | tar xf - -C "$KEEP/fa4wheels"
    wanted=()
    for module in "${!PROVIDES[@]}"; do
        if ! "$PY" -c "import $module" 2>/dev/null; then
            for pattern in ${PROVIDES[$module]}; do wanted+=("$KEEP"/fa4wheels/$pattern); done
        fi
    done
    if (( ${#wanted[@]} )); then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$KEEP/site" "${wanted[@]}" 2>&1 | tail -3
    fi
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
        "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)"
        echo "installed here: ${wanted[*]##*/}"
        "$PY" -c "import flash_attn.cute as f; print('flash_attn.cute', getattr(f, '__version__', '?'))" 2>&1 | tail -1
    } | tee "$out/flash-env.txt"
    [[ "$1" == install ]] && exit 0
    timeout "${SUITE_SECONDS:-240}" "$PY" -m pytest -m cuda -q -p no:cacheprovider -k flash tests/ 2>&1 \
        | tee "$out/pytest-flash.txt" | tail -n 30
    timeout "${PRICE_SECONDS:-180}" "$PY" benchmarks/exact_attention_price.py --device cuda --modes sdpa,triton,flash \
        --out "$out/flash-price" 2>&1 | tail -n 25
    ;;
*)
    echo "usage: bash benchmarks/gpu_flash4.sh download|split|add|install|check" >&2
    exit 2
    ;;
esac
