"""Engine configuration: one dataclass, validated on construction."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrt.kernels import cpu


# quantization values that keep projections in blocks (engine.gguf_weights): the deterministic mode is off by default
PACKED_QUANTIZATIONS = ("gguf", "int8", "int4")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF directory (safetensors) or .gguf file; None = default SmolLM2-135M-Instruct
    dtype: str | None = None  # "auto" | "float32" | "bfloat16" | "float16"; None = $AGENTRT_DTYPE, else "auto":
    # bfloat16 on GPU and on CPUs that compute it natively (AVX512-BF16, AMX), float32 on other CPUs.
    # After validation the chosen dtype's name, never "auto"
    device: str | None = None  # "cpu" | "cuda" | "cuda:N"; None = $AGENTRT_DEVICE, else cuda if available
    block_size: int = 16  # tokens per KV block
    kv_superblock_blocks: int = 1  # superblocks (engine.block_pool): blocks handed out as aligned, physically
    # contiguous runs of this many (a power of two) for multi-block allocations, a table growing into the block after
    # its last; the block stays the unit of hashing, matching and eviction. 1 = LRU order only (docs/engine.md)
    kv_cache_bytes: int | None = None  # KV budget; None = 1 GiB on CPU, 90% of free memory on GPU
    num_blocks: int | None = None  # exact block count (overrides kv_cache_bytes; tests)
    gpu_memory_utilization: float | None = None  # vLLM's name, in (0, 1]: the share of memory the KV cache may
    # take, measured once the weights are loaded: on GPU of the device's total memory less what is in use then
    # (vLLM's meaning), on CPU of the host memory available then (MemAvailable). None = kv_cache_bytes' default
    tensor_parallel_size: int = 1  # vLLM's name; only 1: an engine runs on one device
    max_num_seqs: int = 64  # requests in one batch at most
    max_num_batched_tokens: int = 1024  # tokens in one step at most (chunked prefill beyond)
    max_model_len: int | None = None  # context limit; None = the model's
    enable_prefix_caching: bool = True  # reuse and dedup full blocks by content hash
    swa_full: bool = False  # llama.cpp's --swa-full: sliding-window layers keep every block, in one layer group with
    # the full layers, instead of freeing the blocks that left their window (engine.kv_layout)
    recurrent_snapshots: int = 128  # a hybrid model's (Qwen3.5's) recurrent-state snapshots kept at block boundaries
    # for prefix hits (engine.recurrent_state; least recently used dropped); 0 = none: its prompts are always computed
    policy: Any = "fcfs"  # scheduling policy name or engine.policy.SchedulingPolicy instance
    policy_kwargs: dict | None = None  # arguments for a policy given by name
    seed: int = 0  # seed for requests without their own
    num_speculative_tokens: int = 0  # n-gram (prompt lookup) drafts per step for greedy requests; 0 = off
    prompt_lookup_max: int = 3  # longest suffix n-gram to look up
    prompt_lookup_min: int = 1  # shortest suffix n-gram to look up
    speculative_disable_by_batch_size: int | None = 8  # no drafts while more requests run (drafts cost
    # compute, and a big batch has no idle bandwidth for them); None = always draft
    num_scheduler_steps: int = 1  # decode steps per scheduler call (vLLM's multi-step scheduling) while
    # nobody waits and every running request decodes greedily with no log-probs or logit processors:
    # the model loops over them itself (on CPU one C++ call: no Python between steps) and tokens
    # reach the caller in bursts of up to this many; 1 = one step per call
    enable_lora: bool = False  # serve LoRA adapters (engine.lora): requests may name one with lora_request
    max_loras: int = 8  # adapters kept loaded at most (least recently used dropped; a request holds its own)
    max_lora_rank: int = 64  # an adapter of a higher rank is refused
    generation_config: str = "auto"  # sampling defaults (engine.generation_config): "auto" = the checkpoint's
    # generation_config.json, "vllm" = none, or a directory holding such a file
    override_generation_config: dict | None = None  # {field: value} on top of those, e.g. {"temperature": 0.5}
    deterministic: bool | None = None  # batch-invariant kernels: a greedy request's tokens do not depend on what
    # else the engine runs, how its prompt is chunked, prefix-cache hits or preemption (CPU with the C++ kernels;
    # README). None = where it holds and costs little: on for CPU in float32 / bfloat16 with the C++ kernels (0-3%
    # of decode there, docs/engine.md), off with projections kept packed (quantization "gguf" / "int8" / "int4":
    # their batch-invariant path is the blocks' integer one at every row count, ~1/3 of the widened panels'
    # throughput at 32 concurrent calls, docs/benchmarks/quant.md), off on GPU; True = required (an error where it
    # cannot hold, its cost paid where it does); False = off
    kv_host_gib: float = 0.0  # T1 of the KV hierarchy (engine.kv_tiers): host memory for cached blocks evicted
    # from the KV cache, loaded back instead of recomputed (a hybrid model's state snapshots take a quarter of it
    # and of kv_disk_gib: engine.recurrent_tiers); 0 = off
    kv_host_quantization: str | None = None  # "int8": T1 stores blocks as int8 with per-(layer, K/V, head) scales
    # (lossy, about twice the blocks; sequences' first blocks and recent windows kept exact); None: exact
    kv_host_in_place: bool | None = None  # T1 blocks a prefix hit finds are read where they lie (the host tier is the
    # tail of the KV tensor; a sequence's first block and last two are still copied into the pool) instead of copied
    # into the pool (engine.kv_tiers). None = where it can: CPU, exact T1, one full-attention layer group; True =
    # required (an error where it cannot); False = copied, as on GPU
    kv_disk_dir: str | None = None  # T2: a directory of content-hashed KV chunk files, shared by engines on one
    # host and across restarts; None = off
    kv_disk_gib: float | None = None  # T2's bound (least recently used files deleted beyond it); None = 8 GiB
    quantization: str | None = None  # vLLM's name. "gguf": a GGUF model's projections stay in the file's block
    # formats (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K), run by kernels.quant (CPU only; engine.gguf_weights), or an
    # error saying why they cannot; "int8" / "int4": a safetensors model's projections quantized at load to blocks
    # of 32 (Q8_0 / Q4_1, weight-only, per-block fp16 scales; engine.gguf_weights.quantize_model), a mixture's experts
    # included (per expert), CPU only; None: widened to `dtype` at load, but for a mixture's experts shipped in MXFP4
    # (gpt-oss), kept in their blocks on CPU (engine.moe); "none": everything widened. Not the default yet: on the
    # default model a packed bf16 decode step is still slower than the widened one's (docs/benchmarks/quant.md)
    dtype_reason: str = field(default="", init=False)  # how `dtype` was chosen, for the start-up line
    deterministic_default: bool = field(default=False, init=False)  # `deterministic` was None, chosen here: the
    # engine turns it off where the C++ kernels turn out unavailable instead of refusing to start

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size!r}")
        v = self.kv_superblock_blocks
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"kv_superblock_blocks must be a power of two >= 1, got {v!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if isinstance(self.recurrent_snapshots, bool) or not isinstance(self.recurrent_snapshots, int) \
                or self.recurrent_snapshots < 0:
            raise ValueError(f"recurrent_snapshots must be an int >= 0, got {self.recurrent_snapshots!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes!r}")
        if self.gpu_memory_utilization is not None:
            v = self.gpu_memory_utilization
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {v!r}")
            if self.kv_cache_bytes is not None:
                raise ValueError("give kv_cache_bytes or gpu_memory_utilization, not both: each sizes the KV cache")
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1, got {self.tensor_parallel_size!r}: an engine runs on "
                             "one device; serve a larger model on one bigger device, or run one server per device")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens!r}")
        if isinstance(self.num_scheduler_steps, bool) or not isinstance(self.num_scheduler_steps, int) \
                or self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an int >= 1, got {self.num_scheduler_steps!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min!r} "
                             f"and {self.prompt_lookup_max!r}")
        for name, low in (("kv_host_gib", ">= 0"), ("kv_disk_gib", "> 0")):
            v = getattr(self, name)
            if v is None and name == "kv_disk_gib":
                continue
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1 << 20 or v != v
                    or (low == "> 0" and v == 0)):
                raise ValueError(f"{name} must be a number of GiB {low}, got {v!r}")
        if self.kv_disk_dir is not None and (not isinstance(self.kv_disk_dir, str) or not self.kv_disk_dir):
            raise ValueError(f"kv_disk_dir must be a directory path, got {self.kv_disk_dir!r}")
        if self.kv_host_quantization not in (None, "int8"):
            raise ValueError(f"kv_host_quantization must be None or 'int8', got {self.kv_host_quantization!r}")
        if self.kv_host_quantization is not None and not self.kv_host_gib:
            raise ValueError(f"kv_host_quantization ({self.kv_host_quantization!r}) sets the host tier: give kv_host_gib too")
        if self.kv_host_in_place is not None and not isinstance(self.kv_host_in_place, bool):
            raise ValueError(f"kv_host_in_place must be true, false or None (where it can), got {self.kv_host_in_place!r}")
        if self.kv_host_in_place and not self.kv_host_gib:
            raise ValueError("kv_host_in_place reads the host tier's blocks where they lie: give kv_host_gib too")
        if self.kv_host_in_place and self.kv_host_quantization is not None:
            raise ValueError(f"kv_host_in_place needs an exact host tier: its int8 blocks "
                             f"(kv_host_quantization={self.kv_host_quantization!r}) must be widened into the pool")
        if self.kv_disk_gib is not None and self.kv_disk_dir is None:
            raise ValueError(f"kv_disk_gib ({self.kv_disk_gib!r}) sizes the disk tier: give kv_disk_dir too")
        if (self.kv_host_gib or self.kv_disk_dir) and not self.enable_prefix_caching:
            raise ValueError("the KV tiers (kv_host_gib, kv_disk_dir) find blocks by their content hash: they need "
                             "enable_prefix_caching")
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true, false or None (where it holds), got {self.deterministic!r}")
        source = "dtype"
        if self.dtype is None and os.environ.get("AGENTRT_DTYPE"):
            self.dtype, source = os.environ["AGENTRT_DTYPE"], "$AGENTRT_DTYPE"
        if self.device is None:
            self.device = os.environ.get("AGENTRT_DEVICE") or None
        if self.dtype is not None and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r} ({source})")
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if self.dtype in (None, "auto"):
            self.dtype, why = auto_dtype(self.device)
            self.dtype_reason = f"auto: {why}"
        else:
            self.dtype_reason = f"set by {source}"
        if self.deterministic is None:  # the default: on where the CPU kernels make it hold cheaply
            self.deterministic = (self.device == "cpu" and self.dtype in ("float32", "bfloat16")
                                  and self.quantization not in PACKED_QUANTIZATIONS)
            self.deterministic_default = True
        if self.kv_host_in_place and self.device != "cpu":
            raise ValueError(f"kv_host_in_place is for a CPU engine, whose host tier is the pool's memory, not device "
                             f"{self.device!r}: a GPU reads host-tier blocks after copying them into its pool")
        if self.deterministic and self.device != "cpu":
            raise ValueError(f"deterministic is implemented for the CPU kernels only, not on device {self.device!r}: "
                             "cuBLAS picks its GEMM kernel by the batch's row count (README, Deterministic outputs)")
        if self.deterministic and self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"deterministic needs dtype float32 or bfloat16 (the C++ kernels'), got {self.dtype!r}")
        if self.quantization not in (None, "gguf", "none", "int8", "int4"):
            raise ValueError(f"quantization must be None, 'gguf', 'int8', 'int4' or 'none', got {self.quantization!r}")
        if self.quantization in PACKED_QUANTIZATIONS and self.device != "cpu":
            raise ValueError(f"quantization={self.quantization!r} runs on CPU only (no GPU kernel for packed blocks yet), "
                             f"not on device {self.device!r}; use quantization='none' to widen the weights")
        if self.quantization in PACKED_QUANTIZATIONS and self.enable_lora:
            raise ValueError(f"quantization={self.quantization!r} does not serve LoRA adapters yet: pass "
                             "enable_lora=False or quantization='none'")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(device: str) -> tuple[str, str]:
    """The fastest dtype on `device` and why: bf16 on GPUs and on CPUs with native bf16 arithmetic
    (AVX512-BF16 or AMX, detected at run time), where it halves the bytes each token reads and the
    library GEMMs run 3-5x faster than fp32; fp32 on other CPUs, where bf16 is converted in software."""
    if device != "cpu":
        return "bfloat16", "GPU"
    names = [name for flag, name in (("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX-BF16")) if flag in cpu.cpu_flags()]
    if names:
        return "bfloat16", f"CPU has {' and '.join(names)}"
    return "float32", "CPU has no native bf16 (AVX512-BF16 or AMX)"


CPU_KV_BYTES = 1 << 30  # the KV budget on CPU when nothing sizes it


def kv_budget(config: EngineConfig) -> tuple[int, str]:
    """The KV cache's byte budget once the weights are loaded, and where it came from (for the start-up line)."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes, "kv_cache_bytes"
    share = config.gpu_memory_utilization
    if config.device == "cpu":
        if share is None:
            return CPU_KV_BYTES, "the CPU default"
        return int(available_host_bytes() * share), f"gpu_memory_utilization {share} of available host memory"
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    if share is None:
        return int(free * 0.9), "90% of free GPU memory"
    used = total - free
    budget = int(total * share) - used
    if budget <= 0:
        raise ValueError(f"gpu_memory_utilization {share} leaves no room for the KV cache: {used / 2**30:.1f} GiB of "
                         f"{total / 2**30:.1f} GiB are in use once the weights are loaded; raise it")
    return budget, f"gpu_memory_utilization {share} of GPU memory"


def available_host_bytes() -> int:
    """Host memory available to new allocations (Linux MemAvailable; elsewhere the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
