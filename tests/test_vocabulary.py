"""One wire vocabulary: the server's schemas, the store, the client and the CLI use core's states
and isolation tiers, and the API refuses a word outside them, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_type_hints

import pytest
from pydantic import ValidationError

from computepool.client.http import ENDED_STATES
from computepool.client.options import build_request
from computepool.core import ENDED, HOLDING, ISOLATIONS, LIVE, STATES, Isolation, Slice
from computepool.server import ServerSettings, create_app
from computepool.store import allocations as store
from computepool.wire.allocation_out import AllocationOut, SliceOut
from computepool.wire.allocations import AllocationCreate


def test_states_partition_and_tiers_agree() -> None:
    assert set(LIVE) | set(ENDED) == set(STATES) and not set(LIVE) & set(ENDED)
    assert set(HOLDING) < set(LIVE) and "pending" not in HOLDING
    assert {i.value for i in Isolation} == set(ISOLATIONS)


def test_every_layer_reads_the_same_words() -> None:
    assert (store.HOLDING, store.LIVE, store.ENDED) == (HOLDING, LIVE, ENDED)
    assert frozenset(ENDED) == ENDED_STATES
    assert set(get_args(AllocationOut.model_fields["state"].annotation)) == set(STATES)
    assert set(get_args(SliceOut.model_fields["isolation"].annotation)) == set(ISOLATIONS)
    hint = get_type_hints(AllocationCreate)["isolation"]
    assert {a for arg in get_args(hint) for a in get_args(arg)} == set(ISOLATIONS)


def test_an_unknown_tier_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError) as e:
        AllocationCreate.model_validate({"gpus": 1, "isolation": "shared"})
    assert e.value.errors()[0]["loc"] == ("isolation",)
    assert AllocationCreate.model_validate({"gpus": 1, "isolation": "mps"}).isolation == "mps"


def test_a_slice_round_trips_through_its_wire_form() -> None:
    s = Slice("n1", 2, 500, 4096, Isolation.MPS, "GPU-abc")
    wire = s.to_wire()
    assert set(wire) == set(SliceOut.model_fields)
    assert SliceOut.model_validate(wire).isolation == "mps"
    assert Slice.from_wire(wire) == s
    assert Slice.from_wire({"device_index": 0}).isolation is Isolation.EXCLUSIVE
    with pytest.raises(ValueError):
        Slice.from_wire({"device_index": 0, "isolation": "shared"})


def test_the_api_document_and_the_client_speak_of_one_request(tmp_path: Path) -> None:
    """The client sends the server's own model: the OpenAPI document's request body is that model,
    and what the client builds from human units is valid for it, unchanged by a round trip."""
    app = create_app(ServerSettings(data_dir=tmp_path, db_url=f"sqlite:///{tmp_path / 'pool.db'}"))
    doc = app.openapi()
    body = doc["paths"]["/api/v1/allocations"]["post"]["requestBody"]["content"]["application/json"]
    name = body["schema"]["$ref"].rsplit("/", 1)[-1]
    assert name == AllocationCreate.__name__
    assert set(doc["components"]["schemas"][name]["properties"]) == set(AllocationCreate.model_fields)
    sent = build_request(gpus="0.5", mem="1GiB", time_limit="1h", node_selector=["zone=a"], ports=(8080,))
    wire = sent.body()
    assert AllocationCreate.model_validate(wire).body() == wire
    assert wire["gpu_milli"] == 500 and wire["time_limit"] == 3600 and wire["ports"] == [8080]
