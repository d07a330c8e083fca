"""What a process runs on: devices, the CPU shim, distributed start-up, seeds, peer loss and
host memory. One module per concern; entry points import the names re-exported here."""

from megatron_rlhf.runtime.cpu_shim import (apply_cpu_shim, compile_on_first_call, cpu_shim_active,
                                            cuda_as_cpu, import_megatron_core, quiet_third_party_warnings)
from megatron_rlhf.runtime.devices import (choose_dtype, cpu_flags, default_dtype, device, has_cuda,
                                           serial_helper_threads)
from megatron_rlhf.runtime.distributed import (all_reduce, barrier, init_distributed, is_rank0,
                                               seed_model_parallel_rng, set_seed, shutdown)
from megatron_rlhf.runtime.memory import peak_host_memory_bytes, reset_peak_host_memory
from megatron_rlhf.runtime.peers import (HEARTBEAT_S, exit_on_lost_peers, is_peer_failure, lost_peers,
                                         lost_peers_message, stop_heartbeat)

__all__ = ["apply_cpu_shim", "compile_on_first_call", "cpu_shim_active", "cuda_as_cpu",
           "import_megatron_core", "quiet_third_party_warnings", "choose_dtype", "cpu_flags",
           "default_dtype", "device", "has_cuda", "serial_helper_threads", "all_reduce", "barrier",
           "init_distributed", "is_rank0", "seed_model_parallel_rng", "set_seed", "shutdown",
           "peak_host_memory_bytes", "reset_peak_host_memory", "HEARTBEAT_S", "exit_on_lost_peers",
           "is_peer_failure", "lost_peers", "lost_peers_message", "stop_heartbeat"]
