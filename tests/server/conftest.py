"""Fixtures the server tests share. A module gets a live server on the tiny model (`srv`: served as
"tiny", checked idle with every KV block free after the module) unless it defines its own `srv`;
`client` (openai), `http` (httpx) and `tok` talk to whichever `srv` the module has."""

import contextlib

import httpx
import openai
import pytest

from tests.conftest import assert_all_blocks_free
from tests.server.live import live_server, tiny_config


@pytest.fixture(scope="session")
def postgres_url():
    """A throw-away PostgreSQL cluster for the session (tests/server/pg.py); skips without binaries."""
    from tests.server.pg import PostgresUnavailable, postgres_cluster

    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(postgres_cluster())
        except PostgresUnavailable as e:
            pytest.skip(str(e))
        yield url


def check_idle(server) -> None:
    """After a module: the engine idle, every KV block free, no per-request structure left."""
    server.wait_idle()
    core = server.state.runtime.engine.core
    assert_all_blocks_free(core)
    assert not any(core.num_tracked().values()), core.num_tracked()


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    with live_server(tiny_config(tiny_model_path, served_model_name="tiny")) as s:
        yield s
        check_idle(s)


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(srv):
    return srv.state.runtime.tokenizer
