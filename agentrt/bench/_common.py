"""Shared bits of the benchmark scripts: machine description and docs/benchmarks.md sections."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    import torch

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{platform.system()} {cpu_name()} ({cpu_flags_line()}), {os.cpu_count()} CPU cores, {dev}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags_line() -> str:
    """The CPU's flags that choose kernels and dtypes here, e.g. "flags: avx2 avx512f avx512_bf16"."""
    from agentrt.kernels import cpu

    flags = cpu.cpu_flags()
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16") if f in flags]
    return "flags: " + (" ".join(have) or "none of avx2 / avx512")


def dtype_on_cpu(dtype) -> str:
    """"bfloat16, CPU avx512_bf16": a torch dtype and the kind of C++ kernels this CPU runs, what the
    per-machine sections of docs/benchmarks.md are titled by."""
    from agentrt.kernels import cpu

    return f"{str(dtype).removeprefix('torch.')}, CPU {cpu.kind()}"


def command() -> str:
    """The command line that reproduces this run, as `agentrt bench NAME ARGS`."""
    argv = sys.argv
    if Path(argv[0]).stem == "agentrt" or (len(argv) > 1 and argv[1] == "bench"):  # agentrt bench NAME / simulate ...
        return "agentrt " + shlex.join(argv[1:])
    return "agentrt bench " + shlex.join([Path(argv[0]).stem, *argv[1:]])  # python -m agentrt.bench.NAME ...


def write_section(title: str, body: str, path: Path = DOCS) -> None:
    """Replace (or append) the `## title` section of docs/benchmarks.md, leaving the others intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEach section is written by its benchmark script.\n"
    stamp = f"Machine: {machine()}  \nCommand: `{command()}`  \nDate: {_dt.date.today().isoformat()}\n\n"
    section = f"## {title}\n\n{stamp}{body.rstrip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text.rstrip() + "\n")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
