"""A program's record shows the KV pins it holds now: in `GET /v1/programs` (which the live page and the demo's
table read) its pins while it runs, none once they expired or it ended, as `/metrics` says."""

from __future__ import annotations

import time

import anyio
import httpx
import pytest

import agentrt
from agentrt._retention import RetentionConfig
from agentrt.programs.demo import ServerView
from tests.server.conftest import check_idle
from tests.server.live import live_server, tiny_config


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    retention = RetentionConfig(default_ttl_s=60.0)  # pins outlast the test unless something releases them
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny", retention=retention)) as s:
        yield s
        check_idle(s)


def pinned_gauge(http: httpx.Client) -> float:
    line = next(ln for ln in http.get("/metrics").text.splitlines() if ln.startswith("agentrt:kv_pinned_blocks "))
    return float(line.split()[1])


def listed(http: httpx.Client, pid: str) -> dict:
    (p,) = [p for p in http.get("/v1/programs", params={"limit": 1000}).json()["data"] if p["id"] == pid]
    return p


def call(http: httpx.Client, pid: str, first: int) -> None:
    r = http.post("/v1/completions", headers={"X-Program-Id": pid},  # 40 prompt tokens + 2: 2 full blocks pinned
                  json={"model": "tiny", "prompt": list(range(first, first + 40)), "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_an_ended_programs_record_holds_no_pins(http):
    a, b = "pins-a", "pins-b"
    call(http, a, 1000)
    call(http, b, 2000)
    for pid in (a, b):
        p = http.get(f"/v1/programs/{pid}").json()
        assert (p["state"], p["kv_blocks_pinned"], p["ttl_s"]) == ("running", 2, 60.0)
    assert pinned_gauge(http) == 4
    ended = http.delete(f"/v1/programs/{a}").json()
    assert (ended["state"], ended["kv_blocks"], ended["kv_blocks_pinned"], ended["kv_blocks_reserved"],
            ended["ttl_s"]) == ("finished", 0, 0, 0, 0.0)
    assert ended["calls_done"] == 1  # what it did stays on the record
    for p in (http.get(f"/v1/programs/{a}").json(), listed(http, a)):
        assert (p["state"], p["kv_blocks_pinned"]) == ("finished", 0)
    assert listed(http, b)["kv_blocks_pinned"] == 2
    deadline = time.monotonic() + 10
    while pinned_gauge(http) != 2:  # the end reaches the engine between steps
        assert time.monotonic() < deadline
        time.sleep(0.05)
    http.delete(f"/v1/programs/{b}")
    assert listed(http, b)["kv_blocks_pinned"] == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_demo_table_through_a_server_shows_the_pins_held_now(srv):
    """`agentrt demo`'s table (ServerView): a program's pins while its tool runs, none once it ended."""
    seen = {}

    @agentrt.tool(ttl=60.0)
    async def lookup() -> None:
        seen["tool"] = [r for r in await view.rows() if r.id == agentrt.current_program_id()]

    @agentrt.program
    async def agent() -> str:
        await agentrt.generate(list(range(3000, 3040)), max_tokens=2, ignore_eos=True)
        await lookup()
        return agentrt.current_program_id()

    async with agentrt.connect(srv.url) as rt, httpx.AsyncClient(base_url=srv.url) as client:
        view = ServerView(rt, client)
        pid = await agent()
        with anyio.fail_after(10):
            while (rows := [r for r in await view.rows() if r.id == pid])[0].state == "running":
                await anyio.sleep(0.05)  # the server hears of the program's end with its last call's end
    ((during,),) = [seen["tool"]]
    assert (during.state, during.kv_pinned) == ("running", 2)
    assert (rows[0].state, rows[0].kv_pinned, rows[0].kv_held) == ("finished", 0, 0)
