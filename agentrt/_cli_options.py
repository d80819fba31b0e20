"""What the commands share: usage errors in one line, and the options `agentrt serve` and `agentrt run-batch`
take: the engine's (EngineConfig fields, with vLLM's flag names) and the LoRA adapters'. Unset options keep
the engine's defaults."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

# flag -> (type, help); each the EngineConfig field of its name
_ENGINE_FLAGS: dict[str, tuple[type, str | None]] = {
    "--max-num-seqs": (int, "requests in one batch at most (default 64)"),
    "--max-num-batched-tokens": (int, "tokens in one step at most, chunked prefill beyond (default 1024)"),
    "--kv-cache-bytes": (int, "the KV cache's size in bytes (default: 1 GiB on CPU, 90%% of free GPU memory)"),
    "--gpu-memory-utilization": (float, ("vLLM's flag: the share of memory, in (0, 1], the KV cache may take once "
                                         "the weights are loaded: on GPU of the device's total less what is in use "
                                         "then, on CPU of the available host memory (instead of --kv-cache-bytes; default: "
                                         "unset)")),
    "--tensor-parallel-size": (int, "vLLM's flag; only 1: an engine runs on one device (default 1)"),
    "--num-blocks": (int, "the KV cache's size in blocks (overrides --kv-cache-bytes; default: from the bytes)"),
    "--kv-superblock-blocks": (int, ("superblocks: a prefill's new blocks handed out as aligned, physically contiguous "
                                     "runs of this many blocks (a power of two), a decode taking the block after its "
                                     "last; cached blocks are never evicted earlier than LRU would (default 1: off; "
                                     "docs/engine.md)")),
    "--max-model-len": (int, "context limit (default: the model's)"),
    "--dtype": (str, "auto, float32, bfloat16 or float16 (default: auto, the fastest on this machine)"),
    "--device": (str, "cpu, cuda or cuda:N (default: cuda when there is one)"),
    "--quantization": (str, ("vLLM's flag. gguf: a GGUF model's projections stay in the file's block formats "
                             "(Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K; CPU); int8 / int4: a safetensors model's quantized "
                             "at load, weight-only, blocks of 32, a mixture's experts included (CPU); none: widened to "
                             "--dtype; default: widened, but a checkpoint's MXFP4 experts (gpt-oss) kept packed on CPU")),
    "--seed": (int, "seed for calls without their own (default 0)"),
    "--num-speculative-tokens": (int, "n-gram (prompt lookup) drafts per step for greedy calls (default 0: off)"),
    "--num-scheduler-steps": (int, ("greedy decode steps per scheduler call (vLLM's multi-step scheduling; tokens "
                                    "come in bursts of this many; default 1)")),
    "--max-loras": (int, "LoRA adapters kept loaded at most (default 8)"),
    "--max-lora-rank": (int, "the highest LoRA rank served (default 64)"),
    "--generation-config": (str, ("sampling defaults for unset request fields: auto (the model's "
                                  "generation_config.json; the default), vllm (none) or a directory holding one")),
}
# the KV tiers below the cache (engine.kv_tiers; docs/engine.md): `serve`, `run-batch` and `run` take them
_KV_TIER_FLAGS: dict[str, tuple[type, str]] = {
    "--kv-host-gib": (float, ("KV tier T1: GiB of host memory keeping cached blocks evicted from the KV cache, "
                              "loaded back instead of recomputed (default 0: off)")),
    "--kv-host-quantization": (str, "int8: T1 keeps blocks as int8 with per-head scales (lossy, ~2x the blocks; "
                                    "default: exact)"),
    "--kv-disk-dir": (str, ("KV tier T2: a directory of content-hashed KV chunk files, shared by servers on this "
                            "host and across restarts (default: off)")),
    "--kv-disk-gib": (float, "T2's size; least recently used files are deleted beyond it (default 8)"),
}
_ENGINE_FLAGS.update(_KV_TIER_FLAGS)
_SWITCHES = ("enable_prefix_caching", "enable_lora", "deterministic", "swa_full", "kv_host_in_place")
KV_HOST_IN_PLACE_HELP = ("a prefix hit reads T1 blocks where they lie instead of copying them into the KV cache "
                         "(default: on where it can: CPU, exact T1, models of one full-attention layer group; "
                         "--no-kv-host-in-place copies them)")
DETERMINISTIC_HELP = ("batch-invariant kernels: a greedy call's tokens do not depend on the other calls, prefix-cache "
                      "hits, chunking or preemption (default: on for CPU in float32 / bfloat16 with the C++ kernels, "
                      "off on GPU; --no-deterministic turns it off; its speed per CPU kind: docs/engine.md)")


def _one_line_error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@contextlib.contextmanager
def one_line_usage_errors() -> Iterator[None]:
    """Inside, every argparse parser (the benchmarks' and the demo's too) reports a bad argument in one line
    on stderr and exits 2, without the usage block, which `--help` prints."""
    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _one_line_error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original  # type: ignore[method-assign]


def usage_error(prog: str, message: str) -> int:
    """Print `prog: error: message` on stderr; the exit status of a usage error."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine's flags and `--lora-modules` (a ServerConfig field: read it as `a.lora_modules`)."""
    g = p.add_argument_group("engine options (unset: the engine's defaults)")
    for flag, (type_, help_) in _ENGINE_FLAGS.items():
        g.add_argument(flag, type=type_, default=None, help=help_)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of shared prompt prefixes (default: on)")
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None, help=DETERMINISTIC_HELP)
    g.add_argument("--kv-host-in-place", action=argparse.BooleanOptionalAction, default=None, help=KV_HOST_IN_PLACE_HELP)
    g.add_argument("--swa-full", action="store_true", default=None,
                   help=("llama.cpp's flag: sliding-window layers keep every KV block instead of freeing those that "
                         "left their window (default: freed; docs/engine.md)"))
    g.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (PEFT directories): a request names one as its model")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='sampling defaults on top of the generation config, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help='LoRA adapters served from the start, as name=path or JSON {"name", "path"} (vLLM\'s flag; '
                        "implies --enable-lora; default: none)")


def add_kv_tier_options(p: argparse.ArgumentParser) -> None:
    """The KV tier flags alone (`agentrt run`, whose other engine options are its runtime's defaults)."""
    g = p.add_argument_group("KV tiers (docs/engine.md)")
    for flag, (type_, help_) in _KV_TIER_FLAGS.items():
        g.add_argument(flag, type=type_, default=None, help=help_)
    g.add_argument("--kv-host-in-place", action=argparse.BooleanOptionalAction, default=None, help=KV_HOST_IN_PLACE_HELP)


def kv_tier_options(a: argparse.Namespace) -> dict[str, Any]:
    """The KV tier fields given on the command line; ValueError naming the flag if `--kv-disk-dir` is not a
    directory this process can write (the disk tier would find that only once the model loaded)."""
    names = [f[2:].replace("-", "_") for f in _KV_TIER_FLAGS] + ["kv_host_in_place"]
    if a.kv_disk_dir is not None:
        check_kv_disk_dir(a.kv_disk_dir)
    return {n: getattr(a, n) for n in names if getattr(a, n) is not None}


def check_kv_disk_dir(path: str) -> None:
    """`--kv-disk-dir`: a directory this process can write, made (with its parents) if missing, as the disk
    tier makes it (engine.kv_disk)."""
    if not path:
        raise ValueError("--kv-disk-dir must be a directory path, got ''")
    p = Path(path).expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or str(e)
        raise ValueError(f"--kv-disk-dir {path!r}: cannot make the directory: {why}") from None
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"--kv-disk-dir {path!r}: cannot write files there: {e.strerror or e}") from None


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields given on the command line (the others keep the engine's defaults); ValueError
    naming the flag for what the engine would find only once the model loaded."""
    if a.seed is not None and not 0 <= a.seed < 2**63:
        raise ValueError(f"--seed must be an int in [0, 2**63 - 1], got {a.seed}")
    if a.max_model_len is not None and a.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {a.max_model_len}")
    if a.kv_disk_dir is not None:
        check_kv_disk_dir(a.kv_disk_dir)
    names = [f[2:].replace("-", "_") for f in _ENGINE_FLAGS] + list(_SWITCHES)
    options = {n: getattr(a, n) for n in names if getattr(a, n) is not None}
    if a.override_generation_config is not None:
        try:
            override = json.loads(a.override_generation_config)
        except ValueError:
            override = None
        if not isinstance(override, dict):
            raise ValueError(f"--override-generation-config must be a JSON object, got {a.override_generation_config!r}")
        options["override_generation_config"] = override
    return options
