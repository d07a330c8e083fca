#!/usr/bin/env bash
# The GPU check (issues 12, 28), run on the GPU machine from the repository root:
#
#   bash tools/gpu_check.sh [--smoke] [--out DIR] [other flags of python -m gpu_check]
#
# The wheels that tools/gpu_prepare.sh put in .whl/ (megatron-core, psutil) and whose
# modules do not import yet are installed into .whl/site (offline, --no-deps), and
# .whl/site, the repository root and tools/ (the gpu_check package) go on PYTHONPATH. The seconds
# this takes are passed to the check (--install-s: its "install" row, not counted in its time
# budget); when the install fails the check still runs (--install-error: the install row fails),
# and when megatron.core does not import it writes the header and that row and runs no stage.
# When the check ends without printing its table (killed, out of memory), this script prints the
# table saved so far (table.txt). It exits with the check's status (non-zero when a stage failed
# or the check was killed). Output goes to --out, default $OUT when set (the device tool returns
# what is written there), else out/gpu_check. Python: $PYTHON, else .venv/bin/python when it
# exists, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT:$ROOT/tools${PYTHONPATH:+:$PYTHONPATH}"
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
started=$(date +%s.%N)
shopt -s nullglob
missing=()
for w in .whl/*.whl; do
    importable "$(module_of "$w")" || missing+=("$w")
done
installed="" install_error=""
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing into .whl/site: ${missing[*]}" >&2
    installed=$(for w in "${missing[@]}"; do basename "$w"; done | paste -sd, -)
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target .whl/site "${missing[@]}" >&2; then
        install_error="pip install of $installed failed (see stderr)"
    fi
    export PYTHONPATH="$ROOT/.whl/site:$PYTHONPATH"
fi
install_s=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')

# the output directory (a later --out wins) and no table of an earlier run in it
out=${OUT:-out/gpu_check}
prev=""
for a in "$@"; do
    [ "$prev" = --out ] && out=$a
    case "$a" in --out=*) out=${a#--out=} ;; esac
    prev=$a
done
rm -f "$out/table.txt" "$out/summary.json"

"$PY" -m gpu_check --out "$out" --install-s "$install_s" \
    --installed "$installed" --install-error "$install_error" "$@"
rc=$?
# the check prints its table and marks summary.json finished; if it could not, print what it saved
if [ -f "$out/table.txt" ] && ! grep -q '"finished": true' "$out/summary.json" 2>/dev/null; then
    echo "gpu_check.sh: the check ended with status $rc before printing its table; the table saved so far:"
    cat "$out/table.txt"
fi
exit $rc
