"""`agentrt demo`: the mix of MCTS, ReAct and chat programs with its table and summary, in-process and
against a server (a live one in this process, or `agentrt serve` started as a child process)."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading

import anyio
import httpx
import pytest

import agentrt
from agentrt.programs.demo import InProcessView, Row
from agentrt.programs.demo import main as demo
from tests.server.live import live_server, tiny_config
from tests.waiting import await_until

SMALL = ["--mcts", "1", "--react", "1", "--chat", "1", "--budget", "4", "--max-steps", "3", "--chat-tokens", "12",
         "--no-live"]


def test_demo_starts_a_server_and_stops_it(tiny_model_path, capfd):
    assert demo(["--model", str(tiny_model_path), *SMALL]) == 0
    out, err = capfd.readouterr()
    assert "summary" in out and "3 programs" in out and "through http://127.0.0.1:" in out
    assert "/ui" in err and "server stopped (exit code 0)" in err


def test_demo_keep_leaves_the_server_and_its_page_up_until_ctrl_c(tiny_model_path):
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.command", "demo", "--model", str(tiny_model_path), *SMALL,
                             "--keep"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            # Ctrl-C reaches it however pytest was launched (a shell's `cmd &` ignores SIGINT, and
                            # Python keeps an ignored SIGINT ignored: the demo would never hear it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue[str | None] = queue.Queue()  # None: its stderr ended (it exited)
    threading.Thread(target=lambda: [*(lines.put(ln) for ln in proc.stderr), lines.put(None)], daemon=True).start()
    try:
        seen = []
        while not any("stays up" in ln for ln in seen):
            line = lines.get(timeout=300)
            assert line is not None, f"demo --keep exited ({proc.wait()}) before it said so:\n{''.join(seen)}"
            seen.append(line)
        (url,) = re.findall(r"live page (http://127\.0\.0\.1:\d+)/ui", seen[-1])
        page = httpx.get(f"{url}/ui", timeout=30)
        assert page.status_code == 200 and "agentrt" in page.text
        programs = httpx.get(f"{url}/v1/programs", timeout=30).json()["data"]
        assert len(programs) == 3 and {p["state"] for p in programs} == {"finished"}  # the demo's, kept
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    rest = "".join(iter(lambda: lines.get(timeout=10), None))  # to its end: the process has exited
    assert "server stopped (exit code 0)" in rest and "Traceback" not in rest, rest
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.slow
def test_demo_in_process(default_model_path, capsys):
    assert demo(["--in-process", "--model", str(default_model_path), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "summary" in out and "3 programs" in out and "(verified)" in out and "KV in use" in out
    for name in ("mcts", "react", "chat"):
        assert name in out


@pytest.mark.slow
def test_demo_against_a_server(default_model_path, capsys):
    with live_server(tiny_config(default_model_path, engine={"num_blocks": 512})) as s:
        assert demo(["--url", s.url, *SMALL]) == 0
        programs = list(s.state.runtime.programs)
    out = capsys.readouterr().out
    assert "summary" in out and f"through {s.url}" in out and "(verified)" in out
    assert [p.state for p in programs] == ["finished"] * 3
    assert max(p.num_threads for p in programs) >= 2  # MCTS: threads of one program on the server


async def _row(view: InProcessView, program_id: str) -> Row:
    (row,) = [r for r in await view.rows() if r.id == program_id]
    return row


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_table_shows_the_pins_a_program_holds_now(tiny_model_path):
    """The KV pinned column: a program's pins while its tool runs; 0 once they expired, while it still runs;
    0 once it ended (its record kept the pins it had at its last call's end)."""
    seen: dict[str, Row] = {}

    @agentrt.tool(ttl=60.0)
    async def long_tool() -> None:
        seen["tool"] = await _row(view, agentrt.current_program_id())

    @agentrt.tool(ttl=0.2)
    async def short_tool() -> None:
        pid = agentrt.current_program_id()
        with anyio.fail_after(10):
            while (await _row(view, pid)).kv_pinned:
                await anyio.sleep(0.05)
        seen["expired"] = await _row(view, pid)

    @agentrt.program
    async def agent() -> str:
        await agentrt.generate(list(range(1000, 1040)), max_tokens=2, ignore_eos=True)  # 41 computed: 2 full blocks
        await long_tool()
        await agentrt.generate(list(range(2000, 2040)), max_tokens=2, ignore_eos=True)
        await short_tool()
        await agentrt.generate(list(range(3000, 3040)), max_tokens=2, ignore_eos=True)  # pinned again at its end
        seen["last"] = await _row(view, agentrt.current_program_id())
        return agentrt.current_program_id()

    async with agentrt.Runtime(str(tiny_model_path), num_blocks=64) as rt:
        view = InProcessView(rt)
        pid = await agent()
        ended = await _row(view, pid)
        await await_until(lambda: rt.kv_stats().num_pinned_blocks == 0, "the ended program's pins to go",
                          describe=rt.kv_stats)
        pinned_now = rt.kv_stats().num_pinned_blocks
    assert (seen["tool"].state, seen["tool"].kv_pinned) == ("running", 2)
    assert (seen["expired"].state, seen["expired"].kv_pinned) == ("running", 0)
    assert seen["last"].kv_pinned == 2
    assert (ended.state, ended.kv_pinned, ended.kv_held, pinned_now) == ("finished", 0, 0, 0)
