"""Server test fixtures: a real PostgreSQL for the session, and the app on SQLite and on PostgreSQL.

PostgreSQL is started from the binaries in /usr/lib/postgresql/*/bin (initdb + pg_ctl) in a
temporary folder on a free port, as an unprivileged user when the tests run as root. Missing
binaries fail the tests with a message: CI installs them (`apt-get install postgresql`).
"""

from __future__ import annotations

import contextlib
import glob
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Api, PgServer, TestClient, free_port, os_user

from computepool.server import ServerSettings, create_app


def _pg_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.fail(
            "PostgreSQL binaries not found under /usr/lib/postgresql/*/bin (need initdb and pg_ctl): "
            "install them, e.g. `apt-get install postgresql`. The server tests run on SQLite AND PostgreSQL.",
            pytrace=False,
        )
    return Path(found[-1]).parent


@pytest.fixture(scope="session")
def postgres() -> Iterator[PgServer]:
    bindir = _pg_bindir()
    user = os_user()
    root = Path(tempfile.mkdtemp(prefix="cpool-pg-"))
    root.chmod(0o755)
    if user:
        shutil.chown(root, user)
    pg = PgServer(bindir=bindir, root=root, port=free_port(), os_user=user)
    try:
        pg.init()
        pg.start()
    except subprocess.CalledProcessError as e:
        log = (root / "log").read_text() if (root / "log").exists() else ""
        pytest.fail(f"could not start PostgreSQL: {e.stderr or e.stdout}\n{log}", pytrace=False)
    try:
        yield pg
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            pg.stop("immediate")
        # thousands of small files: remove them in the background rather than hold up the session
        subprocess.Popen(["rm", "-rf", str(root)], start_new_session=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'pool.db'}"
    pg: PgServer = request.getfixturevalue("postgres")
    return pg.new_database()


@pytest.fixture
def make_api(db_url: str, tmp_path: Path) -> Iterator[Callable[..., Api]]:
    clients: list[TestClient] = []

    def make(**overrides: Any) -> Api:
        settings = ServerSettings(data_dir=tmp_path / "data", db_url=db_url, **overrides)
        app = create_app(settings)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        return Api(app, client, settings)

    yield make
    for c in reversed(clients):
        c.__exit__(None, None, None)


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api()
