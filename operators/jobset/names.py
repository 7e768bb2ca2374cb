"""Checks for every string that ends up in a manifest (Kubernetes naming rules).

Errors are :class:`ManifestError` (a ``ValueError``) naming the field and the rule, raised when
a :class:`~operators.jobset.manifest.TrainingLaunch` is built, never by the API server later.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from operators.naming import full, image_problem

__all__ = [
    "ManifestError",
    "check_arg",
    "check_dns1123_label",
    "check_dns1123_subdomain",
    "check_env_name",
    "check_image",
    "check_label_key",
    "check_label_value",
    "check_labels",
]


class ManifestError(ValueError):
    """A launch spec that would render an invalid or unsafe manifest."""


# Matched with fullmatch (naming.full): "$" alone would accept a trailing newline.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Args are an argv list handed to exec, never a shell string. These characters only mean
# something to a shell (or, for '$', to Kubernetes' $(VAR) expansion); in an arg they signal a
# string that was built for a shell, or an injection attempt.
_SHELL_CHARS = frozenset(";&|`$<>\n\r\x00")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})


def check_dns1123_label(value: object, what: str, max_len: int = 63) -> str:
    if not full(_DNS1123_LABEL, value) or len(value) > max_len:  # type: ignore[arg-type]
        raise ManifestError(
            f"{what} {value!r}: must be a DNS-1123 label (lowercase letters, digits and '-', "
            f"starting and ending with a letter or digit, at most {max_len} characters)"
        )
    return value


def check_dns1123_subdomain(value: object, what: str) -> str:
    if not full(_DNS1123_SUBDOMAIN, value) or len(value) > 253:  # type: ignore[arg-type]
        raise ManifestError(
            f"{what} {value!r}: must be a DNS-1123 subdomain (lowercase letters, digits, '-' "
            "and '.', at most 253 characters)"
        )
    return value


def check_label_key(key: object, what: str = "label key") -> str:
    if not isinstance(key, str) or not key:
        raise ManifestError(f"{what} {key!r}: must be a non-empty string")
    prefix, _, name = key.rpartition("/")
    if prefix:
        check_dns1123_subdomain(prefix, f"{what} prefix of {key!r}")
    if len(name) > 63 or not full(_LABEL_NAME, name):
        raise ManifestError(
            f"{what} {key!r}: name part must be at most 63 characters of letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit"
        )
    return key


def check_label_value(value: object, what: str = "label value") -> str:
    if not isinstance(value, str) or len(value) > 63 or (value and not full(_LABEL_NAME, value)):
        raise ManifestError(
            f"{what} {value!r}: must be empty or at most 63 characters of letters, digits, "
            "'-', '_' and '.', starting and ending with a letter or digit"
        )
    return value


def label_safe(text: str) -> str:
    """``text`` as a label value: each character a label value may not hold becomes '.', cut
    to 63 characters, and trimmed to start and end with a letter or digit (a step name such as
    ``sweep/train/C1e16-N1.2M-s0`` has slashes, which no label value may)."""
    value = re.sub(r"[^A-Za-z0-9_.-]", ".", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def check_labels(labels: Mapping[str, str], reserved: Iterable[str] = ()) -> dict[str, str]:
    """Validate user labels; ``reserved`` prefixes belong to JobSet/Kueue/Slipway."""
    out: dict[str, str] = {}
    reserved = tuple(reserved)
    for key, value in labels.items():
        check_label_key(key)
        check_label_value(value, f"label {key!r} value")
        if any(key.startswith(p) for p in reserved):
            raise ManifestError(f"label {key!r}: prefixes {', '.join(reserved)} are reserved")
        out[key] = value
    return out


def check_env_name(name: object) -> str:
    if not full(_ENV_NAME, name):
        raise ManifestError(
            f"environment variable name {name!r}: must match [A-Za-z_][A-Za-z0-9_]*"
        )
    return name


def check_env_value(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"environment variable {name}: value must be a string, got {value!r}")
    if "\x00" in value:
        raise ManifestError(f"environment variable {name}: value contains a NUL byte")
    return value


def check_image(image: object) -> str:
    """The image policy every launched container follows (:func:`operators.naming.image_problem`:
    a full reference with a version tag or digest, never ``latest``)."""
    if problem := image_problem(image):
        raise ManifestError(problem)
    return image  # type: ignore[return-value]


def check_arg(arg: object, what: str) -> str:
    if not isinstance(arg, str):
        raise ManifestError(f"{what} {arg!r}: must be a string (args are an argv list)")
    bad = sorted(_SHELL_CHARS.intersection(arg))
    if bad:
        raise ManifestError(
            f"{what} {arg!r}: contains shell metacharacters {''.join(bad)!r}; args are an "
            "argv list passed to exec, never a shell string"
        )
    return arg


def check_command(command: Iterable[object]) -> tuple[str, ...]:
    cmd = tuple(check_arg(c, "command element") for c in command)
    if not cmd or not cmd[0]:
        raise ManifestError("command must not be empty")
    if cmd[0].rsplit("/", 1)[-1] in _SHELLS:
        raise ManifestError(
            f"command {cmd[0]!r} is a shell: run the program directly with an argv list"
        )
    return cmd
