"""`pool.function(secrets=[...])`: the names a function's workers get their tenant's secrets under
(the values never pass through the caller; tests/server/test_secrets.py has the workers' side)."""

from __future__ import annotations

import pytest

from computepool.core.errors import InvalidInput
from computepool.sdk import Pool


def test_function_secrets_become_the_requests_names() -> None:
    pool = Pool(server="http://127.0.0.1:9", token="t")

    @pool.function(cpus="0.5", secrets=["HF_TOKEN", "HF_TOKEN=HUGGING_FACE_HUB_TOKEN"])
    def f() -> int:
        return 1

    assert f.spec.request.body()["secrets"] == [
        {"name": "HF_TOKEN"},
        {"name": "HF_TOKEN", "env": "HUGGING_FACE_HUB_TOKEN"},
    ]
    assert "secrets" not in pool.function(cpus="0.5")(f.fn).spec.request.body()
    for bad in ("HF_TOKEN", ["=X"], ["A="]):
        with pytest.raises(InvalidInput) as e:
            pool.function(secrets=bad)
        assert e.value.where == "secrets"
    pool.close()
