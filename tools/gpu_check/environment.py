"""What the GPU check's header says about the machine: versions and the decode attention backend."""

from __future__ import annotations

import torch

from gpu_check.shapes import Shape


def _version(name: str, module: str | None = None) -> str:
    """An installed distribution's version (its module's ``__version__``, else ``missing``)."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except Exception:  # noqa: BLE001
        try:
            mod = __import__(module or name)
            return getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001
            return "missing"


def _versions() -> dict:
    v = _version
    mc = v("megatron-core")
    if mc == "missing":
        try:
            from megatron.core import package_info

            mc = package_info.__version__
        except Exception:  # noqa: BLE001
            pass
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception as e:  # noqa: BLE001
        cudnn = f"? ({type(e).__name__})"
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn,
            "megatron_core": mc, "transformers": v("transformers"),
            "flash_attn": v("flash-attn", "flash_attn")}


def _decode_attention(shape: Shape, dev: torch.device) -> str:
    """The decode attention backend on ``dev`` and, on CUDA, the SDPA kernel torch takes
    for a folded bf16 decode step of ``shape`` (batch 16, ``verify_context`` keys, rows of
    different lengths); never raises (the header must be written whatever is broken)."""
    try:
        from megatron_rlhf.generation import incremental as inc

        name = inc.attention_backend(dev)
        if name == "flash":
            return f"flash (flash_attn_with_kvcache, flash-attn {_version('flash-attn', 'flash_attn')})"
        if dev.type != "cuda" or name != "sdpa":
            return name
        b, length, d = 16, shape.verify_context, shape.hidden // shape.heads
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(b, shape.heads, 1, d, device=dev, generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(b, shape.kv_heads, length, d, device=dev, generator=g, dtype=torch.bfloat16)
                for _ in range(2))
        lengths = torch.randint(1, length, (b,), device=dev, generator=g)
        kernel = inc.sdpa_kernel_name(q, k, v, inc.attention_mask(lengths, 1, length))
        return f"{name} ({kernel} kernel)"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
