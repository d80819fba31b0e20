"""Shared bits of the benchmark scripts: machine description and the benchmark pages (docs/benchmarks/).

Each `agentrt bench NAME` has one page, docs/benchmarks/NAME.md: its current runs first, newest first, each
with the machine, the command and the date; a run it replaces moves down, under "History", newest first.
docs/benchmarks/README.md is the index, with the headline figures."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import shlex
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"  # one page per benchmark, and the index
HISTORY = "## History"


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
    per-machine sections of the benchmark pages (docs/benchmarks/) are titled by."""
    from agentrt.kernels import cpu

    return f"{str(dtype).removeprefix('torch.')}, CPU {cpu.kind()}"


def command() -> str:
    """The command line that reproduces this run, as `agentrt bench NAME ARGS`."""
    argv = sys.argv
    if Path(argv[0]).stem == "agentrt" or (len(argv) > 1 and argv[1] == "bench"):  # agentrt bench NAME / simulate ...
        return "agentrt " + shlex.join(argv[1:])
    return "agentrt bench " + shlex.join([Path(argv[0]).stem, *argv[1:]])  # python -m agentrt.bench.NAME ...


def bench_name(module: str) -> str:
    """`agentrt bench NAME` of a benchmark module: agentrt.bench.decode_cpu -> decode-cpu."""
    prefix = f"{__package__}."
    if not module.startswith(prefix) or module.count(".") != 2:
        raise ValueError(f"{module!r} is not a benchmark module ({prefix}NAME)")
    return module.removeprefix(prefix).replace("_", "-")


def page(name: str) -> Path:
    """The page of `agentrt bench NAME`."""
    return DOCS / f"{name}.md"


def _split(text: str) -> tuple[str, list[str], list[str]]:
    """A page's head (title and intro), its current sections (`## ...`) and its history entries (`### ...`)."""
    cur, _, hist = text.partition(f"\n{HISTORY}\n")
    head, *sections = re.split(r"(?m)^(?=## )", cur)
    history = [e for e in re.split(r"(?m)^(?=### )", hist) if e.startswith("### ")]
    return head.rstrip() + "\n", [x.rstrip() + "\n" for x in sections], [e.rstrip() + "\n" for e in history]


def _stamp_date(section: str) -> str:
    m = re.search(r"(?m)^Date: (\S+)", section)
    return m.group(1) if m else "undated"


def put_section(text: str, title: str, section: str) -> str:
    """`text` (a page) with `section` (titled `## title`) first among the current runs; the run of that
    title it replaces goes first in History as `### title (its date)`."""
    head, sections, history = _split(text)
    old = next((x for x in sections if x.startswith(f"## {title}\n")), None)
    sections = [section.rstrip() + "\n", *(x for x in sections if x is not old)]
    if old is not None:
        body = old.split("\n", 1)[1].lstrip("\n")
        history.insert(0, f"### {title} ({_stamp_date(old)})\n\n{body.rstrip()}\n")
    out = head + "\n" + "\n".join(sections)
    if history:
        out += f"\n{HISTORY}\n\nEarlier runs, newest first.\n\n" + "\n".join(history)
    return out.rstrip() + "\n"


def write_section(title: str, body: str, path: Path | None = None, *, name: str | None = None) -> Path:
    """Write this run as the `## title` section of its benchmark's page (`name`, or the calling module's
    `bench NAME`; `path` instead of docs/benchmarks/NAME.md), stamped with the machine, command and date:
    first on the page, the run of the same title it replaces moved down into History. Returns the page."""
    if path is None:
        path = page(name or bench_name(sys._getframe(1).f_globals["__name__"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    text = (path.read_text() if path.exists() else
            f"# `agentrt bench {path.stem}`\n\nWritten by the benchmark (`--docs` / `--write-docs`); all "
            f"benchmarks: [index](README.md).\n")
    stamp = f"Machine: {machine()}  \nCommand: `{command()}`  \nDate: {_dt.date.today().isoformat()}\n\n"
    path.write_text(put_section(text, title, f"## {title}\n\n{stamp}{body.rstrip()}\n"))
    return path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        return f"{v:,.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
