#!/usr/bin/env bash
# The project's test command (what the README gives and CI runs):
#   1. install what the tests need and run the default suite on the installed (newest) transformers;
#   2. run the exactness core again on the OLDEST transformers that pyproject.toml declares, in a
#      second virtual environment made here (it borrows torch and the rest from this interpreter
#      and shadows only transformers and what that release pins), and say which versions ran;
#   3. build the documentation site with --strict (when scripts/build_docs.sh exists).
# Why the second run: the package declares a range of transformers releases, and the APIs we use
# (4D masks, cache objects, the forward's cache keyword) moved inside that range before.
# Set SPECDRAFT_SKIP_OLDEST=1 to skip step 2 (e.g. offline, for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# the suite runs in WORKERS processes (pytest-xdist; every test is independent of the others):
# on CI's 2 cores that halves its time; work stealing lets an idle process take tests queued for
# the other, so a few long tests at the end do not leave one core waiting
WORKERS=${WORKERS:-2}

bash scripts/ensure_torch.sh
"$PY" -m pip install --quiet -e ".[test,docs]"
"$PY" -m pytest -q -n "$WORKERS" --dist worksteal

if [[ "${SPECDRAFT_SKIP_OLDEST:-0}" != "1" ]]; then
    oldest=$("$PY" - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"transformers\b", d))
print(re.search(r">=\s*([0-9][0-9.]*)", spec).group(1))
PYEOF
)
    venv=$(mktemp -d)/oldest-transformers
    "$PY" -m venv "$venv"
    # borrow this interpreter's packages (torch, numpy, ...) behind the venv's own, so only
    # transformers and what it pins are installed into the venv (a .pth "import" line runs
    # site.addsitedir, which appends, so the venv's packages win)
    "$PY" - "$venv" <<'PYEOF'
import pathlib, site, sys, sysconfig
venv = pathlib.Path(sys.argv[1])
target = next(venv.glob("lib*/python*/site-packages"))
dirs = list(dict.fromkeys(site.getsitepackages() + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]))
(target / "borrowed.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
PYEOF
    "$venv/bin/python" -m pip install --quiet "transformers==$oldest"
    "$venv/bin/python" - <<'PYEOF'
import torch, transformers
print(f"exactness core on the oldest declared transformers: transformers {transformers.__version__}, torch {torch.__version__}")
PYEOF
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist worksteal \
        tests/test_greedy_identity.py tests/test_sampling_stats.py tests/test_verify_exact.py \
        tests/test_runner.py tests/test_bench.py tests/test_batch.py tests/test_hf_generate.py
    rm -rf "$(dirname "$venv")"
    "$PY" -c "import torch, transformers; print(f'default suite ran on transformers {transformers.__version__}, torch {torch.__version__}')"
fi

if [[ -f scripts/build_docs.sh ]]; then
    bash scripts/build_docs.sh
fi
