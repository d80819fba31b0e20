"""C++ CPU kernels (kernels/csrc/), compiled on first use for the CPU they run on, one build per CPU kind.

The engine on CPU is memory-bound in decode: a one-row projection should cost one read of its
weight, decode attention one read of each sequence's K and V, and a layer a handful of calls rather
than dozens of small torch ops. So, in fp32 and bf16 (`torch.ops.agentrt_cpu_<kind>`):

- `packed_linear(x, w_packed, bias, N)` (fp32) and `packed_linear_bf16(...)`: `x @ w.T + bias` from
  the panel-packed weight (kernels/linear.py);
- `quant_linear(x, w, type, N, bias)` and `quant_dequantize(w, type, N, K)`: `x @ w.T + bias` from a
  weight kept in a GGUF block format, and its decoding (kernels/quant.py);
- `paged_attention_small_q(...)`: attention of sequences with 1-16 query rows read straight from the
  paged cache through the block tables; `paged_attention_bf16(...)`: tiled attention of longer
  query runs (bf16, AVX512-BF16 build only);
- `rms_norm(x, w, eps)`, `add_rms_norm(x, residual, w, eps)`, `silu_and_mul(x)`, and
  `rope_store_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, H)` (rotary embedding of q and
  k fused with the cache write): one pass each, rounding in bf16 where HF's bf16 model rounds.
- `decode_forward(...)` (every decoder layer of a decode step) and `decode_steps(...)` (greedy steps:
  layers, final norm, LM head, argmax); `argmax_rows(logits)`, `topk_rows(x, k)`,
  `logsumexp_rows(x)` and `penalize_rows(...)` (repetition / frequency / presence) for the sampler.

CPU kinds, best first: "avx512_bf16" (AVX512-BF16's bf16 dot products for the bf16 GEMM), "avx512",
"avx2" (x86), and "generic" elsewhere. The CPU's flags are read at run time; `kind()` is the best
kind it supports unless one is forced (`AGENTRT_CPU_ISA=avx2`, or `use_kind("avx2")` for a block),
so each path this CPU supports can be run and tested on it. The best kind is compiled with
`-march=native`, a lower one with `-march=native` minus the instructions it must not use. Each kind
is its own library and op namespace (several load side by side), cached in torch's extension cache
(~/.cache/torch_extensions) under a name holding the kind, a hash of the CPU's flags and a hash of the
sources and the header folders they build against (one venv's): the first build takes ~30-120 s, later
processes load it. The build compiles a copy of the sources kept in its folder, so a copy of the package
installed elsewhere finds the library built.
Builds and loads of one library take an OS file lock, which dies with its process: a build killed
half-way (Ctrl-C, a restarted machine) leaves torch's own `lock` file behind, which would make every
later process wait for it forever, so the holder of our lock removes it.

When no compiler is there, or AGENTRT_CPU_KERNELS=0, `ops()` returns None (with one warning) and
callers keep their torch paths; `use_cpu_kernels(False)` (a context manager, process-wide like the
kernel backend) turns them off for a block, e.g. to measure or test the torch paths.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV_VAR = "AGENTRT_CPU_KERNELS"  # "0" disables the C++ kernels
ISA_ENV_VAR = "AGENTRT_CPU_ISA"  # force a CPU kind: avx512_bf16, avx512, avx2 or generic
KINDS = ("avx512_bf16", "avx512", "avx2", "generic")  # best first
_CSRC = Path(__file__).parent / "csrc"
_SOURCE = _CSRC / "cpu_ops.cpp"
_FLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]
# What a kind needs from the CPU, and what to switch off when building it for a better CPU.
_REQUIRES = {
    "avx512_bf16": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx512": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl"),
    "avx2": ("avx2", "fma"),
    "generic": (),
}
_DISABLE = {"avx512_bf16": [], "avx512": ["-mno-avx512bf16"], "avx2": ["-mno-avx512f"], "generic": []}

_lock = threading.Lock()
# "kind": forced by use_kind; "env_kind": $AGENTRT_CPU_ISA or the best kind, resolved on first use;
# "ops": kind -> loaded namespace, or None once a build failed
_state: dict = {"enabled": True, "kind": None, "env_kind": None, "ops": {}}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (/proc/cpuinfo); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 dot products or AMX tiles)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def supported_kinds() -> tuple[str, ...]:
    """The CPU kinds this machine can run, best first ("generic" off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags = cpu_flags()
    return tuple(k for k in KINDS[:-1] if all(f in flags for f in _REQUIRES[k])) or ("generic",)


def native_kind() -> str:
    return supported_kinds()[0]


def _validated_kind(name: str, source: str) -> str:
    if name not in KINDS:
        raise ValueError(f"unknown CPU kind {name!r} ({source}); expected one of {', '.join(KINDS)}")
    if name not in supported_kinds():
        raise ValueError(f"CPU kind {name!r} ({source}) needs CPU flags {', '.join(_REQUIRES[name])}; this CPU "
                         f"supports {', '.join(supported_kinds())}")
    return name


def kind() -> str:
    """The CPU kind whose kernels `ops()` returns: forced by `use_kind` or $AGENTRT_CPU_ISA (read on first
    use), else the best this CPU supports."""
    if _state["kind"] is not None:
        return _state["kind"]
    if _state["env_kind"] is None:
        forced = os.environ.get(ISA_ENV_VAR)
        _state["env_kind"] = _validated_kind(forced, f"environment variable {ISA_ENV_VAR}") if forced else native_kind()
    return _state["env_kind"]


def _cpu_tag() -> str:
    """A short tag of this CPU's flags: `-march=native` builds are cached per CPU, so a shared cache
    directory never hands a library to a CPU that lacks its instructions."""
    return hashlib.sha1(f"{platform.machine()} {' '.join(sorted(cpu_flags())) or platform.processor()}".encode()
                        ).hexdigest()[:8]


@functools.cache
def _source_tag() -> str:
    """A hash of the sources and of the header folders they build against (torch's and Python's, which a build's
    commands name): another venv's build has its own folder, instead of each venv's first process rebuilding the
    library the other built (~1-2 min a kind)."""
    import sysconfig

    from torch.utils import cpp_extension

    digest = hashlib.sha1()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update("\n".join([*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]).encode())
    return digest.hexdigest()[:8]


def build_directory(kind_name: str) -> Path:
    """Where the library of `kind_name` is built and cached: torch's extension cache, in the folder torch
    itself would pick for this Python and torch build."""
    from torch.utils import cpp_extension

    cuda = torch.version.cuda
    folder = f"py{sys.version_info.major}{sys.version_info.minor}_{'cu' + cuda.replace('.', '') if cuda else 'cpu'}"
    name = f"agentrt_cpu_{kind_name}_{_cpu_tag()}_{_source_tag()}"
    return Path(cpp_extension.get_default_build_root()) / folder / name


def library_path(kind_name: str) -> Path:
    """The built library of `kind_name` in its build folder (there once built)."""
    build_dir = build_directory(kind_name)
    return build_dir / f"{build_dir.name}.so"


def _sources_in(build_dir: Path) -> Path:
    """The C++ sources copied into `build_dir` (a file only where its bytes differ, so its time stays), and the
    main file there. Built from there, the build's commands name no path of this copy of the package: a wheel
    installed elsewhere, whose sources hash the same, finds the library built and loads it, where a build from
    its own path would make ninja rebuild it (~70 s), and the next process from the other path again."""
    src = build_dir / "src"
    src.mkdir(exist_ok=True)
    for path in (p for p in _CSRC.iterdir() if p.is_file()):
        data, there = path.read_bytes(), src / path.name
        if not there.exists() or there.read_bytes() != data:
            there.write_bytes(data)
    return src / _SOURCE.name


def _build(kind_name: str):
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    from torch.utils import cpp_extension

    bindir = str(Path(sys.executable).parent)  # ninja installed into a venv that is not activated
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    namespace = f"agentrt_cpu_{kind_name}"
    flags = [*_FLAGS, "-march=native", *_DISABLE[kind_name], f"-DAGENTRT_NS={namespace}"]
    try:
        build_dir = build_directory(kind_name)
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "agentrt.flock", "a") as held:
            fcntl.flock(held, fcntl.LOCK_EX)  # released by the OS when this process dies
            (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, left by a build that was killed
            source = _sources_in(build_dir)
            cpp_extension.load(name=build_dir.name, sources=[str(source)], build_directory=str(build_dir),
                               extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
                               verbose=False)
    except Exception as e:  # no compiler or ninja, or a build error: keep the torch paths
        log.warning("agentrt C++ CPU kernels (%s) unavailable (%s: %s); using torch paths", kind_name,
                    type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    return getattr(torch.ops, namespace)


def ops(kind_name: str | None = None):
    """The compiled ops of `kind_name` (default: `kind()`), e.g. `torch.ops.agentrt_cpu_avx2`, or None when
    they cannot be built or are disabled."""
    if not _state["enabled"]:
        return None
    kind_name = kind_name or _state["kind"] or _state["env_kind"] or kind()  # the model calls this per op: no work
    loaded = _state["ops"]
    if kind_name not in loaded:
        _validated_kind(kind_name, "ops")
        with _lock:
            if kind_name not in loaded:
                loaded[kind_name] = _build(kind_name)
    return loaded[kind_name]


def compiled_isa(kind_name: str | None = None) -> str | None:
    """What the kernels of `kind_name` (default: `kind()`) were compiled for, e.g. "avx512_bf16" (a compiler
    without AVX512-BF16 support builds that kind as "avx512"); None without kernels."""
    o = ops(kind_name)
    if o is None:
        return None
    kind_name = kind_name or kind()
    isas = _state.setdefault("isa", {})
    if kind_name not in isas:
        isas[kind_name] = o.isa()
    return isas[kind_name]


def available(kind_name: str | None = None) -> bool:
    return ops(kind_name) is not None


@contextmanager
def use_cpu_kernels(enabled: bool) -> Iterator[None]:
    """Turn the C++ kernels on or off inside a `with` block (restoring the previous setting after)."""
    previous = _state["enabled"]
    _state["enabled"] = bool(enabled)
    try:
        yield
    finally:
        _state["enabled"] = previous


@contextmanager
def use_kind(kind_name: str) -> Iterator[None]:
    """Run the kernels of CPU kind `kind_name` inside a `with` block (process-wide, like `use_cpu_kernels`)."""
    previous = _state["kind"]
    _state["kind"] = _validated_kind(kind_name, "use_kind")
    try:
        yield
    finally:
        _state["kind"] = previous


def amx() -> bool:
    """Whether the bf16 projections of this process run on AMX (a Sapphire Rapids-class CPU, the avx512_bf16
    kind, Linux granting the tile state, and not `AGENTRT_CPU_AMX=0`); else the AVX512-BF16 or AVX2 tiles."""
    o = ops()
    return o is not None and bool(o.amx())


def describe() -> str:
    """One line for logs: the kernels in use, e.g. "C++ avx512_bf16 + AMX", "C++ avx2" or "torch (no C++ kernels)"."""
    o = ops()
    if o is None:
        return "torch (no C++ kernels)"
    return f"C++ {o.isa()}" + (" + AMX" if o.amx() else "")
