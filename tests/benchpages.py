"""The benchmark pages (docs/benchmarks/*.md) as they are now: a benchmark run without --docs leaves them alone."""

from __future__ import annotations

from agentrt.bench._common import DOCS


def pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(DOCS.glob("*.md"))}
