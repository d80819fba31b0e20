"""`agentrt programs show ID [--url URL]`: a program's timeline in the terminal, from a server's
`GET /v1/programs/{id}/timeline` (agentrt._timeline), drawn with rich: a row per thread, each call in
characters over a shared time axis (`░` queued, `▒` prefill, `█` decode, `x` preempted, `·` a tool gap),
and the program's totals."""

from __future__ import annotations

import argparse
import os
from typing import Any

QUEUED, PREFILL, DECODE, PREEMPTED, GAP = "░", "▒", "█", "x", "·"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("programs", help="inspect a server's programs (agentrt programs show ID)")
    ps = p.add_subparsers(dest="programs_cmd", required=True)
    show = ps.add_parser("show", help="draw a program's timeline: its calls' queued / prefill / decode per thread")
    show.add_argument("program_id")
    show.add_argument("--url", default="http://127.0.0.1:8000", help="the agentrt serve server (default: %(default)s)")
    show.add_argument("--api-key", default=None, help="its API key (default: $AGENTRT_API_KEY)")
    show.add_argument("--width", type=int, default=None, help="characters of the time axis (default: the terminal's)")
    show.set_defaults(fn=show_program)


def bar(row: dict[str, Any], t0: float, t1: float, width: int) -> str:
    """One thread's calls and gaps as `width` characters over [t0, t1]."""
    cells = [" "] * width

    def paint(a: float, b: float, ch: str) -> None:
        i = int((a - t0) / (t1 - t0) * width)
        j = max(i + 1, int((b - t0) / (t1 - t0) * width))
        for k in range(max(0, i), min(width, j)):
            cells[k] = ch

    for g in row["gaps"]:
        paint(g["start_at"], g["end_at"], GAP)
    for c in row["calls"]:
        sched = c["scheduled_at"] if c["scheduled_at"] is not None else c["end_at"]
        first = c["first_token_at"] if c["first_token_at"] is not None else c["end_at"]
        paint(c["arrival_at"], sched, QUEUED)
        if sched < first:
            paint(sched, first, PREFILL)
        if first < c["end_at"]:
            paint(first, c["end_at"], DECODE)
        for p in c["preemptions"]:
            paint(p["at"], p["resumed_at"] if p["resumed_at"] is not None else c["end_at"], PREEMPTED)
    return "".join(cells)


def render(tl: dict[str, Any], width: int) -> list[Any]:
    """The rich renderables of a timeline (GET /v1/programs/{id}/timeline's JSON)."""
    from rich.table import Table

    t0 = tl["started_at"]
    t1 = max(tl["ended_at"] if tl["ended_at"] is not None else tl["now"], t0 + 1e-3)
    rows = Table(title=f"{tl['program_id']} {tl['name']} · {tl['state']} · {t1 - t0:.2f} s", show_edge=False)
    rows.add_column("thread", no_wrap=True)
    rows.add_column("calls", justify="right")
    rows.add_column(f"0 s {'─' * max(0, width - 12)} {t1 - t0:.2f} s", no_wrap=True)
    pid = tl["program_id"]
    for row in tl["threads"]:
        name = row["thread_id"][len(pid):] if row["thread_id"].startswith(pid) else row["thread_id"]
        rows.add_row(name or row["thread_id"], str(len(row["calls"])), bar(row, t0, t1, width))
    t = tl["totals"]
    totals = Table(show_header=False, show_edge=False)
    for k, v in (("calls", f"{t['calls']} ({t['calls_in_flight']} in flight)"), ("queued", f"{t['queued_s']:.2f} s"),
                 ("prefill", f"{t['prefill_s']:.2f} s"), ("decode", f"{t['decode_s']:.2f} s"),
                 ("tool gaps", f"{t['tool_s']:.2f} s"), ("service", f"{t['service_s']:.2f} s"),
                 ("preemptions", str(t["num_preemptions"])),
                 ("prompt / cached / tier tokens",
                  f"{t['num_prompt_tokens']} / {t['num_cached_tokens']} / {t['num_tier_loaded_tokens']}"),
                 ("output tokens", str(t["num_output_tokens"])), ("replicas", ", ".join(t["replicas"]) or "-")):
        totals.add_row(k, v)
    legend = f"{QUEUED} queued  {PREFILL} prefill  {DECODE} decode  {PREEMPTED} preempted  {GAP} tool gap"
    return [rows, legend, totals]


def show_program(a: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console

    key = a.api_key or os.environ.get("AGENTRT_API_KEY")
    try:
        r = httpx.get(f"{a.url.rstrip('/')}/v1/programs/{a.program_id}/timeline", timeout=30,
                      headers={"Authorization": f"Bearer {key}"} if key else {})
    except httpx.HTTPError as e:
        raise SystemExit(f"cannot reach {a.url}: {e}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise SystemExit(f"{a.url}: HTTP {r.status_code}: {message}")
    console = Console()
    width = a.width if a.width is not None else max(20, console.width - 30)
    if width < 10:
        raise SystemExit(f"--width must be at least 10, got {width}")
    for part in render(r.json(), width):
        console.print(part)
    return 0
