"""TPU preflight: a definite "not offered" fails; anything the API cannot answer only warns."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from operators.jobset.catalogue import ShapeError, resolve
from operators.jobset.preflight import (
    AcceleratorNotOffered,
    accelerator_type_name,
    check_accelerator_offered,
)
from tests.fakes.tpu_api import FakeTpuClient, accelerator_type

PROJECT = "slipway-test"
ZONE = "us-east5-a"


def _type(name: str, topology: str | None = None) -> Any:
    return accelerator_type(name, topology, project=PROJECT, zone=ZONE)


ZONE_TYPES = [
    _type("v5litepod-4", "2x2"),
    _type("v5litepod-16", "4x4"),
    _type("v5p-8", "2x2x1"),
    _type("v5p-32", "2x2x4"),
]


def test_offered_type_and_topology_is_verified(caplog):
    client = FakeTpuClient(ZONE_TYPES)
    with caplog.at_level(logging.INFO, logger="operators.jobset.preflight"):
        result = check_accelerator_offered(
            resolve("v5p", "2x2x4", 2), project=PROJECT, zone=ZONE, client=client
        )
    assert result.status == "offered" and result.verified
    assert result.offered == ("v5p-32", "v5p-8")
    assert client.calls == [
        {"parent": f"projects/{PROJECT}/locations/{ZONE}", "timeout": 20.0, "retry": None}
    ]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_name_matches_when_the_api_gives_no_topology():
    client = FakeTpuClient([_type("v5litepod-16")])
    result = check_accelerator_offered(
        resolve("v5e", "4x4"), project=PROJECT, zone=ZONE, client=client
    )
    assert result.status == "offered"


def test_generation_missing_from_the_zone_is_a_clear_error():
    client = FakeTpuClient(ZONE_TYPES)
    with pytest.raises(AcceleratorNotOffered) as err:
        check_accelerator_offered(resolve("v6e", "2x4"), project=PROJECT, zone=ZONE, client=client)
    message = str(err.value)
    assert "v6e" in message and ZONE in message and "v5litepod, v5p" in message
    assert isinstance(err.value, ShapeError)  # callers treating shape errors see it too


def test_zone_without_any_tpu_is_an_error():
    with pytest.raises(AcceleratorNotOffered, match="no TPU types"):
        check_accelerator_offered(
            resolve("v4", "2x2x1"), project=PROJECT, zone=ZONE, client=FakeTpuClient([])
        )


def test_offered_generation_with_unlisted_shape_only_warns(caplog):
    client = FakeTpuClient(ZONE_TYPES)
    with caplog.at_level(logging.WARNING, logger="operators.jobset.preflight"):
        result = check_accelerator_offered(
            resolve("v5p", "4x4x8"), project=PROJECT, zone=ZONE, client=client
        )
    assert result.status == "shape_unlisted" and not result.verified
    assert "4x4x8" in result.message and "v5p-256" in result.message
    assert any("4x4x8" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "error_name", ["PermissionDenied", "Unauthenticated", "ServiceUnavailable", "DeadlineExceeded"]
)
def test_api_errors_degrade_to_a_warning(error_name, caplog):
    from google.api_core import exceptions

    client = FakeTpuClient(error=getattr(exceptions, error_name)("no"))
    with caplog.at_level(logging.WARNING, logger="operators.jobset.preflight"):
        result = check_accelerator_offered(
            resolve("v5e", "2x2"), project=PROJECT, zone=ZONE, client=client
        )
    assert result.status == "unverified" and error_name in result.message
    assert any(error_name in r.getMessage() for r in caplog.records)


def test_cpu_and_regions_are_skipped_without_asking():
    client = FakeTpuClient(error=AssertionError("must not be called"))
    cpu = check_accelerator_offered(resolve("cpu", "2"), project=PROJECT, zone=ZONE, client=client)
    region = check_accelerator_offered(
        resolve("v5e", "2x2"), project=PROJECT, zone="us-east5", client=client
    )
    assert cpu.status == region.status == "skipped" and client.calls == []


def test_project_and_credentials_are_looked_up_inside_the_check():
    client = FakeTpuClient(ZONE_TYPES)
    result = check_accelerator_offered(
        resolve("v5e", "2x2"), project=lambda: PROJECT, zone=ZONE, client=client
    )
    assert result.verified and client.calls[0]["parent"].startswith(f"projects/{PROJECT}/")


def _no_credentials() -> Any:
    from google.auth.exceptions import DefaultCredentialsError

    raise DefaultCredentialsError("no credentials in this connection")


@pytest.mark.parametrize(
    ("project", "credentials", "expected"),
    [
        (None, None, "no usable GCP project"),
        (lambda: None, None, "no usable GCP project"),
        (PROJECT, _no_credentials, "DefaultCredentialsError"),
        (_no_credentials, None, "DefaultCredentialsError"),
    ],
)
def test_missing_project_or_credentials_only_warns(project, credentials, expected):
    """As the training operator calls it: project and credentials from its GCP connection,
    through callables that may fail (no connection, no key, no project)."""
    result = check_accelerator_offered(
        resolve("v5e", "2x2"), project=project, zone=ZONE, credentials=credentials
    )
    assert result.status == "unverified" and expected in result.message


@pytest.mark.parametrize(
    ("project", "zone"),
    [("Bad Project", ZONE), (PROJECT, "us-east5-a/../x"), (PROJECT, ""), ("", ZONE)],
)
def test_malformed_project_or_zone_is_refused(project, zone):
    with pytest.raises(ValueError, match="TPU preflight"):
        check_accelerator_offered(
            resolve("v5e", "2x2"), project=project, zone=zone, client=FakeTpuClient(ZONE_TYPES)
        )


@pytest.mark.parametrize(
    ("acc", "topology", "name"),
    [
        ("v4", "2x2x1", "v4-8"),
        ("v5p", "2x2x4", "v5p-32"),
        ("v5e", "2x4", "v5litepod-8"),
        ("v6e", "16x16", "v6e-256"),
        ("tpu7x", "2x2x1", None),
    ],
)
def test_accelerator_type_names(acc, topology, name):
    assert accelerator_type_name(resolve(acc, topology)) == name


# -- the real client, with no API to reach ---------------------------------------------------


def test_real_client_that_cannot_reach_the_api_warns(caplog):
    """google-cloud-tpu's own TpuClient (gRPC), pointed at a closed local port: the call fails
    the way an unreachable API does, and the launch is only warned."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    client = tpu_v2.TpuClient(
        credentials=AnonymousCredentials(), client_options={"api_endpoint": "127.0.0.1:9"}
    )
    with caplog.at_level(logging.WARNING, logger="operators.jobset.preflight"):
        result = check_accelerator_offered(
            resolve("v5e", "2x2"), project=PROJECT, zone=ZONE, client=client, timeout=5
        )
    assert result.status == "unverified"
    # An API error, not a programming error swallowed by the fallback.
    assert "ServiceUnavailable" in result.message or "DeadlineExceeded" in result.message
    assert caplog.records


def test_real_client_without_credentials_warns(monkeypatch, tmp_path):
    """No client passed and no Application Default Credentials: the real client cannot even
    be built; that is a warning too."""
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    result = check_accelerator_offered(resolve("v6e", "2x4"), project=PROJECT, zone=ZONE)
    assert result.status == "unverified"
    assert "DefaultCredentialsError" in result.message
