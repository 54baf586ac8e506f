"""Server test fixtures (the server and attack tests' conftests import them): a real PostgreSQL for
the session, and the app on SQLite and on PostgreSQL.

PostgreSQL is started from the binaries in /usr/lib/postgresql/*/bin (initdb + pg_ctl) in a
temporary folder on a free port, as an unprivileged user when the tests run as root. Missing
binaries fail the tests with a message: CI installs them (`apt-get install postgresql`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from harness import Api, PgServer, TestClient, free_port, os_user

from computepool.server import ServerSettings, create_app
from computepool.store.db import Database
from computepool.store.migrate import upgrade


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


# Modules whose tests run on both databases: the store and its migrations, commits that race, counts
# that could overflow or collide, and at least one path through each router. The rest run on SQLite
# alone; CPOOL_TEST_ALL_DATABASES=1 runs every test on both (worth it when store/ changes).
BOTH_DATABASES = {
    "test_store_migrations",
    "test_log_streams_migration",
    "test_allocations",
    "test_allocations_agent",
    "test_scheduling",
    "test_scheduling_statement",
    "test_gangs",
    "test_blobs",
    "test_edges",
    "test_hot_path",
    "test_api_auth",
    "test_api_audit",
    "test_api_bad_input",
    "test_api_tokens",
    "test_audit_anchor",
    "test_functions_api",
    "test_function_batches",
    "test_ledger_accrual",
    "test_services_api",
    "test_peers_api",
    "test_coop_api",
    "test_alerts",
    "test_quota_words",
    "test_idle_reclaim",
    "test_time_limits",
    "test_request_defaults",
    "test_image_admission",
    "test_secrets_api",
    "test_throughputs",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`backend` is SQLite, and also PostgreSQL where the database matters (see BOTH_DATABASES)."""
    if "backend" not in metafunc.fixturenames:
        return
    if any(m.name == "parametrize" and "backend" in m.args[0] for m in metafunc.definition.iter_markers()):
        return  # the test names its own backends
    both = (
        os.environ.get("CPOOL_TEST_ALL_DATABASES", "") in ("1", "true", "yes")
        or metafunc.module.__name__.rsplit(".", 1)[-1] in BOTH_DATABASES
    )
    metafunc.parametrize("backend", ["sqlite", "postgresql"] if both else ["sqlite"])


def _migrate(url: str) -> None:
    db = Database(url)
    try:
        upgrade(db)
    finally:
        db.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once per session, copied for each test (migrations are tested on their own)."""
    path = tmp_path_factory.mktemp("template") / "pool.db"
    _migrate(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_template(postgres: PgServer) -> str:
    return postgres.make_template(_migrate)


@pytest.fixture
def db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated database of the test's own."""
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        for suffix in ("", "-wal", "-shm"):
            src = template.with_name(template.name + suffix)
            if src.exists():
                shutil.copyfile(src, tmp_path / f"pool.db{suffix}")
        yield f"sqlite:///{tmp_path / 'pool.db'}"
        return
    pg: PgServer = request.getfixturevalue("postgres")
    name = pg.copy_template(request.getfixturevalue("pg_template"))
    yield pg.url(name)
    with contextlib.suppress(psycopg.Error):
        pg.drop(name)


@pytest.fixture
def empty_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A database with no tables at all: for the tests of the migrations themselves."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
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
