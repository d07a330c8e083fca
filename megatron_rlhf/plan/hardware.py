"""What a machine sustains, for the cost estimator: a roofline :class:`Hardware` (named ones
in :data:`HARDWARE`) or a measured per-layer :class:`Profile`; both round-trip through JSON."""
# Hardware holds FLOP/s, memory and link bandwidths and latencies; a Profile is one model
# shape's per-layer timings measured by tools/profile_costs.py.

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_rlhf.config import ModelConfig


@dataclass(frozen=True)
class Hardware:
    """What a device and its links sustain (not their data-sheet peaks)."""

    name: str
    flops: float  # Dense matmul FLOP/s of one device in the model's dtype.
    mem_bw: float  # Device memory bytes/s.
    # Bytes/s per device in a collective inside a node (NCCL bus bandwidth over NVLink).
    intra_bw: float
    inter_bw: float  # Bytes/s per device in a collective across nodes (the NIC's share).
    latency_s: float = 20e-6  # Fixed cost of one collective or one point-to-point transfer.
    # Fixed cost per layer and forward launched eagerly (kernel launches, Python).
    layer_overhead_s: float = 0.0
    decode_overhead_s: float = 0.0  # Fixed cost per layer of one decode step (0 with CUDA graphs).
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    # Latency of each of a ring all-reduce's ``2 (g-1)`` steps (0: one ``latency_s`` per
    # all-reduce).
    ring_latency_s: float = 0.0
    # Bytes/s of a reduce-scatter inside a node, in ``t = latency + (g-1)/g * bytes / bw``
    # (0: the all-reduce's bus bandwidth ``intra_bw``).
    reduce_scatter_bw: float = 0.0
    # Fixed cost of one reduce-scatter (used with ``reduce_scatter_bw``).
    reduce_scatter_latency_s: float = 0.0
    # Bytes/s of an all-gather inside a node, as ``reduce_scatter_bw`` (0: ``intra_bw``).
    all_gather_bw: float = 0.0
    all_gather_latency_s: float = 0.0  # Fixed cost of one all-gather (used with ``all_gather_bw``).
    # Memory traffic of the optimizer step per parameter of its shard: torch's per-tensor
    # AdamW as megatron runs it without a fused kernel (weight decay 8 B, first moment 12,
    # second 24, the denominator's three passes 24, the update 16) plus the gradient norm (4)
    # and clipping (8); a fused Adam reads and writes 16 B per parameter (32).
    optimizer_bytes_per_param: float = 96.0
    # CPU cores the ranks of a node share (0: a device of its own per rank, never
    # oversubscribed).
    cores: int = 0
    threads_per_rank: int = 1

    @property
    def oversubscribed(self) -> bool:
        """More busy threads than cores on a node: a rank that waits gives its core away."""
        return self.cores > 0 and self.gpus_per_node * self.threads_per_rank > self.cores

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path) -> "Hardware":
        return cls(**json.loads(Path(path).read_text()))


HARDWARE = {
    # sustained rates, not peaks: large-GEMM FLOP/s, HBM bandwidth, NCCL bus bandwidth
    # (GPU optimizers: fused Adam, 32 B per parameter)
    "h100": Hardware("h100", flops=600e12, mem_bw=2.8e12, intra_bw=360e9, inter_bw=45e9,
                     latency_s=20e-6, layer_overhead_s=30e-6, gpu_memory_gb=80.0,
                     optimizer_bytes_per_param=32.0),
    "h200": Hardware("h200", flops=650e12, mem_bw=4.0e12, intra_bw=360e9, inter_bw=45e9,
                     latency_s=20e-6, layer_overhead_s=30e-6, gpu_memory_gb=141.0,
                     optimizer_bytes_per_param=32.0),
    "a100": Hardware("a100", flops=230e12, mem_bw=1.7e12, intra_bw=230e9, inter_bw=23e9,
                     latency_s=25e-6, layer_overhead_s=30e-6, gpu_memory_gb=80.0,
                     optimizer_bytes_per_param=32.0),
    # a small CPU host with gloo between processes, rough: tools/profile_costs.py measures one
    "cpu": Hardware("cpu", flops=1.5e11, mem_bw=7e9, intra_bw=2e9, inter_bw=1e9,
                    latency_s=1e-4, layer_overhead_s=3e-4, decode_overhead_s=3e-4,
                    gpus_per_node=2, gpu_memory_gb=12.0, cores=2),
}


@dataclass(frozen=True)
class Datasheet:
    """A GPU model's published peaks, and the :data:`HARDWARE` preset that prices it."""

    preset: str  # Key in HARDWARE.
    model: str  # The part the figures are for.
    marker: str  # Upper-case text in ``torch.cuda.get_device_name()`` that names this GPU.
    memory_gb: float
    bf16_tflops: float  # Dense, without sparsity.
    hbm_tb_s: float
    nvlink_gb_s: float  # Per GPU, both directions together.


DATASHEETS = (
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)
    Datasheet("h200", "H200 SXM 141GB", "H200", memory_gb=141, bf16_tflops=989, hbm_tb_s=4.8,
              nvlink_gb_s=900),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)
    Datasheet("h100", "H100 SXM 80GB", "H100", memory_gb=80, bf16_tflops=989, hbm_tb_s=3.35,
              nvlink_gb_s=900),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column)
    Datasheet("a100", "A100 SXM4 80GB", "A100", memory_gb=80, bf16_tflops=312, hbm_tb_s=2.039,
              nvlink_gb_s=600),
)


def device_preset(device_name: str, memory_gb: float) -> tuple[Datasheet, str]:
    """``(datasheet, how)`` for a GPU named ``device_name`` with ``memory_gb`` of memory:
    the first of :data:`DATASHEETS` whose marker the name contains, else the one closest in
    memory (ties: the lower peak FLOP/s). ``how`` says which of the two it was."""
    name = device_name.upper()
    for sheet in DATASHEETS:
        if sheet.marker in name:
            return sheet, f"matched by name ({sheet.marker})"
    sheet = min(DATASHEETS, key=lambda s: (abs(s.memory_gb - memory_gb), s.bf16_tflops))
    return sheet, (f"an unknown GPU: the preset closest in memory ({memory_gb:.0f} GB against "
                   f"{sheet.memory_gb:g} GB)")


@dataclass
class Profile:
    """Measured per-layer seconds at TP=1 for one model shape (``tools/profile_costs.py``)."""
    # forward: a forward of ``tokens`` tokens; train: forward + backward; decode: a step of
    # ``batch`` samples after ``context`` cached tokens; head: the LM head per token count.

    shape: str
    tokens: list[int]
    forward: list[float]
    train: list[float]
    head: list[float]
    batches: list[int]
    decode: list[float]
    context: int
    # The :class:`Hardware` fitted alongside (links, collectives, cores, overheads).
    hardware: dict = field(default_factory=dict)
    # The LM head's forward + backward per token count, with the loss's log-probs and
    # entropy (empty: three forwards).
    head_train: list[float] = field(default_factory=list)
    # TP size -> ``{"tokens", "forward", "train", "head", "head_train"}``: the same tables
    # measured on TP-sharded models (every TP group of the machine busy at once, the
    # all-reduces included), for token counts from ``tokens[0]`` on.
    tp_tables: dict = field(default_factory=dict)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path) -> "Profile":
        """The Profile at ``path`` (older profiles' ``FILE.meta.json`` beside it included)."""
        # Older profiles kept the head's backward, the TP tables, the collective fits and
        # the cores in that meta file.
        data = json.loads(Path(path).read_text())
        meta = Path(path).with_name(Path(path).stem + ".meta.json")
        if meta.is_file() and "head_train" not in data:
            data = merge_meta(data, json.loads(meta.read_text()))
        return cls(**data)

    def tp_table(self, tp: int, name: str, tokens: float) -> float | None:
        """Seconds of table ``name`` at ``tp`` for ``tokens`` (None: not measured there)."""
        t = self.tp_tables.get(str(tp), self.tp_tables.get(tp))
        if tp <= 1 or not t or not t.get(name) or tokens < t["tokens"][0]:
            return None
        return interp(t["tokens"], t[name], tokens)


def merge_meta(data: dict, meta: dict) -> dict:
    """``data`` (a Profile's fields) completed from ``meta``, ``tools/profile_costs.py``'s meta file."""
    # The head's forward + backward, the TP tables, and into ``hardware`` the per-step
    # all-reduce fit, the reduce-scatter and all-gather fits and the cores the ranks shared.
    data = dict(data, hardware=dict(data.get("hardware", {})))
    data.setdefault("head_train", meta.get("head_train_s", []))
    data.setdefault("tp_tables", meta.get("tp_tables", {}))
    hw = data["hardware"]
    ring = meta.get("ring_fit")
    if ring and "ring_latency_s" not in hw:  # a bandwidth and a latency from the one fit
        hw.update(ring_latency_s=ring["latency_per_step_s"], intra_bw=ring["bus_bw"],
                  inter_bw=ring["bus_bw"])
    for op in ("reduce_scatter", "all_gather"):
        fit = meta.get(f"{op}_fit")
        if fit:
            hw.setdefault(f"{op}_bw", fit["bw"])
            hw.setdefault(f"{op}_latency_s", fit["latency_s"])
    if "cores" in meta:
        hw.setdefault("cores", meta["cores"])
        hw.setdefault("threads_per_rank", meta.get("key", {}).get("threads", 1))
    return data


def shape_key(cfg: ModelConfig) -> str:
    """The key of a model's shape in a profile table (layers, widths, heads, vocabulary)."""
    return (f"{cfg.num_layers}x{cfg.hidden_size}/{cfg.ffn_hidden_size} h{cfg.num_attention_heads}"
            f"/{cfg.num_query_groups} v{cfg.padded_vocab_size}")


def interp(xs: list, ys: list, x: float) -> float:
    """Piecewise-linear in x, extrapolated linearly (proportionally beyond the largest)."""
    if x <= xs[0]:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
