import contextlib

import pytest


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
