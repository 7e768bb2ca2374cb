"""No secret, token or key in anything Slipway deploys or documents.

Scanned: the rendered Helm chart (default values and ``values-production.yaml``), the chart's
files (values files, schema, templates), every JobSet manifest the operators render (each
catalogue TPU type and example topology, 1, 2 and 4 slices), everything under ``docker/`` and
the README and docs. Looked for: private keys (PEM), Google service-account key JSON, Google
API keys, OAuth tokens, AWS keys, GitHub/Slack tokens, URLs with a password, literal
password/token/secret assignments, and, in manifests, secret-named environment variables with
a literal value, ConfigMap keys named like secrets, and Secret objects with data. References
(``$VAR``, ``$(cmd)``, ``<placeholder>``, ``{{ template }}``, ``secretKeyRef``) are fine: a
secret lives in a Kubernetes Secret the user creates, never in a file here.

The last tests plant secrets and check that the scanner finds each one, so it can fail.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from operators.jobset.catalogue import CATALOGUE
from operators.jobset.manifest import TrainingLaunch

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "slipway"
VALUES_FILES = {"default": None, "production": CHART / "values-production.yaml"}


@dataclass(frozen=True)
class Finding:
    where: str
    rule: str
    excerpt: str

    def __str__(self) -> str:
        return f"{self.where}: {self.rule}: {self.excerpt}"


# --------------------------------------------------------------------------------------------
# the scanner

# Always a secret, wherever it appears.
TOKEN_RULES: dict[str, re.Pattern[str]] = {
    "private key": re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"),
    "service-account key JSON": re.compile(r"""["']private_key(?:_id)?["']\s*:\s*["'][^"']+"""),
    "Google API key": re.compile(r"\bAIza[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])"),
    "Google OAuth access token": re.compile(r"\bya29\.[0-9A-Za-z_\-]{20,}"),
    "Google OAuth refresh token": re.compile(r"(?<![0-9A-Za-z])1//0[0-9A-Za-z_\-]{30,}"),
    "AWS access key id": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    "GitHub token": re.compile(r"\b(?:gh[pousr]_[0-9A-Za-z]{36}|github_pat_[0-9A-Za-z_]{40,})\b"),
    "Slack token": re.compile(r"\bxox[abposr]-[0-9A-Za-z-]{10,}"),
    "bearer token": re.compile(r"(?i)\bbearer\s+[0-9A-Za-z\-._~+/]{20,}=*"),
}

# A secret only when the value is a literal (not a reference or placeholder).
_SECRET_WORDS = (
    r"password|passwd|passphrase|pwd|secret|token|api[_-]?key|apikey|secret[_-]?key"
    r"|access[_-]?key|private[_-]?key|client[_-]?secret|auth[_-]?token|access[_-]?token"
    r"|refresh[_-]?token|aws_secret_access_key|credentials?"
)
ASSIGNMENT = re.compile(
    rf"""(?ix)(?<![A-Za-z0-9_.-])(?P<key>{_SECRET_WORDS})(?![A-Za-z0-9])["']?[ \t]*[:=][ \t]*
    (?P<value>"[^"\n]*"|'[^'\n]*'|[^\s,;}})\]#]+)"""
)
URL_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s:@'\"]+:(?P<value>[^/\s@'\"]+)@")
# Env var / ConfigMap key names that hold secrets.
SECRET_NAME = re.compile(
    r"(?i)(PASSWORD|PASSWD|PASSPHRASE|TOKEN|SECRET|CREDENTIAL|PRIVATE_?KEY|API_?KEY|ACCESS_?KEY|(^|_)KEY$)"
)


# Mapping keys (in values files and manifests) whose scalar value would be the secret itself,
# including the Airflow chart's own literal-secret values (fernetKey, jwtSecret, ...).
SECRET_VALUE_KEY = re.compile(
    r"(?i)^(password|passwd|pass|passphrase|pwd|token|api_?key|access_?key|private_?key"
    r"|client_?secret|secret_?access_?key|fernet_?key|webserver_?secret_?key|api_?secret_?key"
    r"|jwt_?secret|secret_key)$"
)


def is_reference(value: str) -> bool:
    """A value that points at a secret instead of holding one."""
    v = value.strip().strip("\"'").strip()
    return (
        not v
        or v.lower() in {"null", "none", "~", "true", "false", "required", "optional"}
        or v.startswith(("$", "<", "{{", "%(", "***", "...", "…"))
        or bool(re.fullmatch(r"\*+|x+|X+|redacted|REDACTED", v))
    )


def scan_text(text: str, where: str) -> list[Finding]:
    found: list[Finding] = []
    for rule, pattern in TOKEN_RULES.items():
        found += [Finding(where, rule, m.group(0)[:60]) for m in pattern.finditer(text)]
    for m in ASSIGNMENT.finditer(text):
        key, value = m.group("key"), m.group("value")
        # `secretKey:` (camelCase) names a key inside a Secret (secretKeyRef, the Airflow
        # chart's `secret` list): a reference by construction. A Capitalised key is prose
        # ("Secret: it names ..."), and so is an unquoted short plain word after a key.
        if key == "secretKey" or (key[0].isupper() and not key.isupper()):
            continue
        prose = value[0] not in "\"'" and value.isalpha() and len(value) < 12
        if not prose and not is_reference(value):
            found.append(Finding(where, f"literal {m.group('key').lower()}", m.group(0)[:80]))
    for m in URL_PASSWORD.finditer(text):
        if not is_reference(m.group("value")):
            found.append(Finding(where, "password in URL", m.group(0)[:80]))
    return found


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield f"{path}/{key}", key, value
            yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


def scan_object(obj: Any, where: str) -> list[Finding]:
    """A manifest or values document: its text, plus the structure (env, ConfigMap, Secret)."""
    found = scan_text(yaml.safe_dump(obj, sort_keys=False, width=1000), where)
    if (
        isinstance(obj, Mapping)
        and obj.get("kind") == "Secret"
        and (obj.get("data") or obj.get("stringData"))
    ):
        found.append(Finding(where, "Secret with data", obj["metadata"]["name"]))
    if isinstance(obj, Mapping) and obj.get("kind") == "ConfigMap":
        for key in obj.get("data") or {}:
            if SECRET_NAME.search(key):
                found.append(Finding(where, "secret-named ConfigMap key", key))
    for path, key, value in _walk(obj):
        if (
            isinstance(key, str)
            and SECRET_VALUE_KEY.match(key)
            and isinstance(value, str | int | float)
            and not isinstance(value, bool)
            and not is_reference(str(value))
        ):
            found.append(Finding(f"{where}{path}", "literal secret value", key))
        if key != "env" or not isinstance(value, list):
            continue
        for entry in value:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                continue
            literal = entry.get("value")
            if (
                SECRET_NAME.search(entry["name"])
                and literal is not None
                and not is_reference(str(literal))
            ):
                found.append(
                    Finding(
                        f"{where}{path}", "secret-named env with a literal value", entry["name"]
                    )
                )
    return found


# --------------------------------------------------------------------------------------------
# what gets scanned


def _text_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and not any(part in {"__pycache__", ".git"} for part in path.parts):
            try:
                path.read_text()
            except UnicodeDecodeError:
                continue  # binary: nothing readable to leak in text form
            yield path


def doc_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    docker = REPO / "docker"
    if docker.is_dir():
        files += list(_text_files(docker))
    return [f for f in files if f.is_file()]


def chart_files() -> list[Path]:
    # charts/slipway/charts/ would hold the downloaded Airflow chart: not ours to scan.
    # (relative to the checkout: a clone may itself sit in a folder named slipway/)
    return [
        p
        for p in _text_files(REPO / "charts")
        if p.relative_to(REPO / "charts").parts[:2] != ("slipway", "charts")
    ]


def rendered_chart(which: str, chart_dir: Path = CHART) -> dict[str, str]:
    values = {} if VALUES_FILES[which] is None else yaml.safe_load(VALUES_FILES[which].read_text())
    values.setdefault("airflow", {})["enabled"] = False  # the dependency is not downloaded here
    with helm.Chart.load(chart_dir) as chart:
        return chart.render(values, name="slipway", namespace="slipway")


def scan_rendered(files: Mapping[str, str], which: str) -> list[Finding]:
    found: list[Finding] = []
    for name, text in sorted(files.items()):
        where = f"rendered[{which}]:{name}"
        found += scan_text(text, where)
        if name.endswith((".yaml", ".yml")):
            for obj in yaml.safe_load_all(text):
                if obj:
                    found += scan_object(obj, where)
    return found


@cache
def jobset_manifests() -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every shape the catalogue documents (its example topologies), 1/2/4 slices, with the
    options a production launch sets (service account, queue, labels, env)."""
    out = []
    for name, acc in sorted(CATALOGUE.items()):
        for topology in acc.examples:
            for slices in (1, 2, 4):
                spec = TrainingLaunch(
                    name="run-1",
                    image="us-central1-docker.pkg.dev/acme-slipway-prod/slipway/slipway-trainer:0.1.0",
                    config_uri="gs://acme-slipway-prod-slipway/slipway/runs/run-1/config.json",
                    accelerator=name,
                    topology=topology,
                    slices=slices,
                    namespace="slipway-training",
                    service_account="slipway-trainer",
                    queue="slipway-tpu",
                    labels={"app.kubernetes.io/part-of": "slipway"},
                    env={"SLIPWAY_HOME": "gs://acme-slipway-prod-slipway/slipway"},
                )
                out.append((f"jobset[{name} {topology} x{slices}]", spec.render()))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# the scans


@pytest.mark.parametrize("which", sorted(VALUES_FILES))
def test_rendered_chart_has_no_secrets(which: str) -> None:
    files = rendered_chart(which)
    assert any(n.endswith("configmap.yaml") for n in files)
    assert scan_rendered(files, which) == []
    # The chart never renders a Secret (it names the ones the user creates).
    kinds = {
        o["kind"]
        for name, text in files.items()
        if name.endswith(".yaml")
        for o in yaml.safe_load_all(text)
        if isinstance(o, dict)
    }
    assert "Secret" not in kinds


def test_chart_files_have_no_secrets() -> None:
    files = chart_files()
    names = {p.name for p in files}
    assert {"values.yaml", "values-production.yaml", "values.schema.json", "Chart.yaml"} <= names
    found: list[Finding] = []
    for path in files:
        text = path.read_text()
        where = str(path.relative_to(REPO))
        found += scan_text(text, where)
        if path.name.startswith("values") and path.suffix == ".yaml":
            found += scan_object(yaml.safe_load(text), where)  # env lists, e.g. airflow.env
    assert [str(f) for f in found] == []


def test_jobset_manifests_have_no_secrets() -> None:
    manifests = jobset_manifests()
    # Every catalogue type, each example topology, three slice counts.
    assert len(manifests) == 3 * sum(len(a.examples) for a in CATALOGUE.values())
    found: list[Finding] = []
    for where, manifest in manifests:
        found += scan_object(manifest, where)
        found += scan_text(json.dumps(manifest), where)
    assert [str(f) for f in found] == []


def test_docs_and_images_have_no_secrets() -> None:
    files = doc_files()
    assert REPO / "README.md" in files and REPO / "docs" / "deploy.md" in files
    found = [f for path in files for f in scan_text(path.read_text(), str(path.relative_to(REPO)))]
    assert [str(f) for f in found] == []


# --------------------------------------------------------------------------------------------
# the scanner can fail: planted secrets are found
#
# Samples are assembled at run time so that this file holds no secret-shaped literal itself.


def _planted() -> dict[str, str]:
    pem_kind = "RSA " + "PRIVATE KEY"
    return {
        "private key": f"-----BEGIN {pem_kind}-----\nMIIEow"
        + "A" * 40
        + f"\n-----END {pem_kind}-----",
        "service-account key JSON": json.dumps(
            {
                "type": "service_account",
                "private_key_" + "id": "0f" * 20,
                "client_email": "x@p.iam.gserviceaccount.com",
            }
        ),
        "Google API key": "key=" + "AI" + "za" + "Sy" + "Q7d" * 11,
        "Google OAuth access token": "Authorization header ya" + "29." + "a0AfB_" + "x" * 40,
        "Google OAuth refresh token": "refresh: 1/" + "/0g" + "Z" * 40,
        "AWS access key id": "AK" + "IA" + "Q" * 16,
        "GitHub token": "gh" + "p_" + "a1" * 18,
        "Slack token": "xo" + "xb-" + "1234567890-abcdef",
        "bearer token": "curl -H 'Authorization: Bear" + "er " + "eyJhbGciOi" + "J" * 30 + "'",
        "literal password": "pass" + "word: hunter2-correct-horse",
        "literal api_key": "api" + "_key = 'sk-live-1234567890'",
        "literal secret": "sec" + "ret=s3cr3t-value",
        "password in URL": "postgresql://slipway:" + "hunter2" + "@10.20.0.3:5432/slipway_lineage",
    }


@pytest.mark.parametrize("rule", sorted(_planted()))
def test_scanner_finds_planted_secret(rule: str) -> None:
    text = f"Some documentation.\n\n    {_planted()[rule]}\n\nMore text.\n"
    found = scan_text(text, "planted.md")
    assert rule in {f.rule for f in found}, found


@pytest.mark.parametrize(
    "text",
    [
        'kubectl create secret generic slipway-lineage-db --from-literal=password="$(openssl rand -base64 24)"',
        "password: $LINEAGE_DB_PASSWORD",
        "token: <your-token>",
        "secret: {{ .Values.secretName }}",
        "  secretKeyRef:\n    name: slipway-lineage-db\n    key: password",
        "postgresql+psycopg://slipway@10.20.0.3:5432/slipway_lineage?sslmode=require",
        "postgresql://airflow:${AIRFLOW_DB_PASSWORD}@10.20.0.3:5432/airflow",
        "passwordSecret:\n  name: slipway-lineage-db\n  key: password",
        "PGPASSWORD comes from a Secret; POST /auth/token gives a bearer token for /api/v2",
        "secret:\n  - envName: PGPASSWORD",
    ],
)
def test_scanner_accepts_references(text: str) -> None:
    assert scan_text(text, "doc.md") == []


def test_scanner_finds_literal_secret_env_in_a_jobset() -> None:
    # TrainingLaunch takes any env: a credential passed that way must not slip through.
    key_name = "WANDB_API_" + "KEY"
    spec = TrainingLaunch(
        name="run-1",
        image="slipway-trainer:0.1.0",
        config_uri="gs://b/c.json",
        env={key_name: "0123456789abcdef"},
    )
    found = scan_object(spec.render(), "jobset")
    assert [(f.rule, f.excerpt) for f in found] == [
        ("secret-named env with a literal value", key_name)
    ]


def test_scanner_finds_secrets_in_a_rendered_chart(tmp_path: Path) -> None:
    """End to end: a copy of the chart with a template that leaks, rendered and scanned."""
    dest = tmp_path / "slipway"
    shutil.copytree(CHART, dest, ignore=shutil.ignore_patterns("charts"))
    token_key = "API_TO" + "KEN"
    (dest / "templates" / "leak.yaml").write_text(
        f"""apiVersion: v1
kind: ConfigMap
metadata:
  name: leak
  namespace: {{{{ .Release.Namespace }}}}
data:
  {token_key}: "abc"
---
apiVersion: v1
kind: Pod
metadata:
  name: leak
spec:
  containers:
    - name: c
      image: slipway-airflow:0.1.0
      env:
        - name: PG{"PASS" + "WORD"}
          value: "hunter2"
        - name: PG{"PASS" + "WORD"}_FROM_SECRET
          valueFrom:
            secretKeyRef: {{name: slipway-lineage-db, key: password}}
---
apiVersion: v1
kind: Secret
metadata:
  name: leak
stringData:
  connection: "x"
"""
    )
    found = scan_rendered(rendered_chart("production", dest), "production")
    rules = sorted((f.rule, f.excerpt) for f in found)
    assert rules == [
        ("Secret with data", "leak"),
        ("secret-named ConfigMap key", token_key),
        ("secret-named env with a literal value", "PG" + "PASS" + "WORD"),
    ]


def test_scanner_finds_secrets_in_values(tmp_path: Path) -> None:
    values = copy.deepcopy(yaml.safe_load((CHART / "values-production.yaml").read_text()))
    values["airflow"]["env"].append(
        {"name": "AIRFLOW__CORE__FERNET_" + "KEY", "value": "not-a-ref"}
    )
    values["airflow"]["data"]["metadataConnection"] = {"user": "airflow", "pass": "postgres"}
    values["airflow"]["fernet" + "Key"] = "c2VjcmV0LWtleQ=="
    found = {(f.rule, f.excerpt) for f in scan_object(values, "values-production.yaml")}
    assert found == {
        ("secret-named env with a literal value", "AIRFLOW__CORE__FERNET_" + "KEY"),
        ("literal secret value", "pass"),
        ("literal secret value", "fernet" + "Key"),
    }
    # Literal-password keys in a values document, as text.
    assert scan_text(yaml.safe_dump({"auth": {"password": "hunter2"}}), "values.yaml")
