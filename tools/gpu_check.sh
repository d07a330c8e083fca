#!/usr/bin/env bash
# The GPU check (issue 12), run on the GPU machine from the repository root:
#
#   bash tools/gpu_check.sh [--smoke] [--out DIR] [other tools/gpu_check.py flags]
#
# The wheels that tools/gpu_prepare.sh put in .whl/ (megatron-core, psutil) and whose
# modules do not import yet are installed into .whl/site (offline, --no-deps), and
# .whl/site and the repository root go on PYTHONPATH. Then tools/gpu_check.py runs; this script exits with its status (non-zero
# when a stage failed). Output goes to --out, default $OUT when set (the device tool
# returns what is written there), else out/gpu_check. Python: $PYTHON, else .venv/bin/python
# when it exists, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

importable() { "$PY" -c "import $1" >/dev/null 2>&1; }

# import name of a wheel file (distribution names differ from module names for a few)
module_of() {
    local dist
    dist=$(basename "$1" | cut -d- -f1 | tr 'A-Z' 'a-z')
    case "$dist" in
        megatron_core) echo megatron.core ;;
        pyyaml) echo yaml ;;
        *) echo "$dist" ;;
    esac
}

# the carried wheels whose modules do not import yet -> .whl/site (offline, --no-deps)
shopt -s nullglob
missing=()
for w in .whl/*.whl; do
    importable "$(module_of "$w")" || missing+=("$w")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing into .whl/site: ${missing[*]}" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target .whl/site "${missing[@]}" || exit 2
    export PYTHONPATH="$ROOT/.whl/site:$PYTHONPATH"
fi
if ! importable megatron.core; then
    echo "error: megatron.core does not import; run tools/gpu_prepare.sh where the package" \
         "registries are reachable and carry .whl (device tool: carry [\".whl\"])" >&2
    "$PY" -c "import megatron.core" >&2
    exit 2
fi

"$PY" tools/gpu_check.py --out "${OUT:-out/gpu_check}" "$@"
