"""The vendored JobSet CRD's schema as a jsonschema validator, for the tests that check what
we send to a cluster (test_jobset_manifest.py) and the fake API server that accepts or refuses
it (tests/fakes/k8s_api.py)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

# vendored beside the renderer (operators/jobset/crd/README.md: which release)
CRD = Path(__file__).resolve().parents[2] / "operators/jobset/crd/jobset.x-k8s.io_jobsets.yaml"


@cache
def crd_validator(*, reject_unknown: bool) -> jsonschema.Validator:
    """The CRD's v1alpha2 schema, ``x-kubernetes-int-or-string`` spelled out for jsonschema
    (loaded once per process and setting: the file is 800 kB). The API server *prunes* fields
    the schema does not know (drops them silently); ``reject_unknown`` refuses them instead,
    so that a typo in a manifest fails rather than vanishes."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(CRD.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = _structural(version["schema"]["openAPIV3Schema"], reject_unknown)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)


def _structural(schema: Any, reject_unknown: bool) -> Any:
    if isinstance(schema, list):
        return [_structural(s, reject_unknown) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _structural(v, reject_unknown) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        reject_unknown
        and out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out
