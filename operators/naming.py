"""Full-string checks for the GCP names and image references a run can carry.

One pattern per kind of name, each matched with :func:`re.fullmatch` (a pattern anchored with
``$`` alone accepts a trailing newline, which would then reach a command line or a manifest).
Character classes are ASCII-only, so unicode look-alikes (a Cyrillic ``а``, a fullwidth ``／``)
never pass. Used by the run form's checks (:mod:`operators.params`), the Dataflow settings
(:mod:`operators.beam_stage`), the JobSet manifest (:mod:`operators.jobset.names`), the GKE
cluster settings and the TPU preflight. Standard library only.
"""

from __future__ import annotations

import re

__all__ = [
    "GCS_PATH",
    "GKE_CLUSTER",
    "PROJECT",
    "REGION",
    "SERVICE_ACCOUNT",
    "ZONE",
    "full",
    "image_problem",
    "is_location",
]

# A project id, optionally domain-scoped (example.com:my-project).
PROJECT = re.compile(r"(?:[a-z][a-z0-9.-]*[a-z0-9]:)?[a-z][a-z0-9-]{4,28}[a-z0-9]")
REGION = re.compile(r"[a-z]+(?:-[a-z]+)+[0-9]+")  # us-central1, europe-west4
ZONE = re.compile(r"[a-z]+(?:-[a-z]+)+[0-9]+-[a-z]")  # us-central2-b
GKE_CLUSTER = re.compile(r"[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?")
# gs://bucket[/path]: bucket naming rules; path characters that need no quoting anywhere.
GCS_PATH = re.compile(r"gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](?:/[A-Za-z0-9._~=+@,/-]*)?")
SERVICE_ACCOUNT = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}@[a-z0-9][a-z0-9.-]*\.gserviceaccount\.com")
# An OCI image reference: registry host (a port only before a path: "name:123" is a tag) or
# the first path part, path components, then a tag and/or a sha256 digest.
IMAGE = re.compile(
    r"(?P<repo>[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]{1,5}(?=/))?"
    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?"
)
MAX_IMAGE_CHARS = 512


def full(pattern: re.Pattern[str], value: object) -> bool:
    """Whether ``value`` is a string that ``pattern`` matches from its first to last character."""
    return isinstance(value, str) and pattern.fullmatch(value) is not None


def is_location(value: object) -> bool:
    """A GCP region (us-central2) or zone (us-east5-a): where a GKE cluster can be."""
    return full(REGION, value) or full(ZONE, value)


def image_repository(image: str) -> str | None:
    """The repository part of a valid image reference (no tag, no digest), else None."""
    match = IMAGE.fullmatch(image) if isinstance(image, str) else None
    return match["repo"] if match else None


def image_problem(image: object, what: str = "image") -> str | None:
    """Why ``image`` cannot be launched, or None. One policy for every image Slipway runs (the
    trainer's JobSet pods, the Dataflow workers): a full reference with a version tag or a
    digest, since lineage records which container produced what and ``latest`` moves."""
    match = IMAGE.fullmatch(image) if isinstance(image, str) else None
    if match is None or len(image) > MAX_IMAGE_CHARS:  # type: ignore[arg-type]
        return (
            f"{what} {image!r} is not an image reference "
            "(REGISTRY/PATH/NAME:TAG or @sha256:DIGEST, lowercase path, no spaces)"
        )
    if not match["tag"] and not match["digest"]:
        return f"{what} {image!r} needs a tag or digest (lineage records it)"
    if match["tag"] == "latest" and not match["digest"]:
        return f"{what} {image!r}: 'latest' is not reproducible; use a version tag or digest"
    return None
