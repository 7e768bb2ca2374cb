"""The three images, checked from their Dockerfiles without a Docker daemon.

For each image: the base is pinned to what requirements.lock says (Beam and Airflow versions,
the Python the lock is resolved for), the final stage runs as a numeric non-root user, the
image installs exactly the dependency set pyproject.toml declares for it (through
docker/requirements.py and the lock) and nothing else, the code it ships imports nothing that
set does not declare, its entrypoint module exists, the build context leaves out the heavy
and secret things, and no build argument or variable is named like a secret.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
OWN_PACKAGES = {"pipelines", "trainer", "tokenstore", "operators"}


@dataclass(frozen=True)
class Image:
    dockerfile: str
    extras: tuple[str, ...]  # what pyproject declares for the image...
    dependencies: bool  # ...plus [project].dependencies
    packages: tuple[str, ...] = ()  # code whose imports the declared set must cover
    entrypoint: tuple[str, ...] | None = None  # None: the base image's is kept


IMAGES = {
    "trainer": Image(
        "trainer.Dockerfile",
        ("trainer", "tpu"),
        False,
        ("trainer", "tokenstore"),
        ("python", "-m", "trainer.train"),
    ),
    "beam": Image(
        "beam.Dockerfile", ("beam",), False, ("pipelines", "tokenstore"), ("/opt/apache/beam/boot",)
    ),
    # The platform image: the package exactly as pyproject declares it, with the gcp extra
    # (its code is the whole project; the import check below is for the two subsets).
    "airflow": Image("airflow.Dockerfile", ("gcp",), True),
}


# -- a small Dockerfile reader -----------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Stages with their instructions: continuations joined, comment lines dropped."""
    logical, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "a continuation runs off the end of the Dockerfile"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        else:
            assert stages, f"{keyword} before FROM"
            stages[-1].instructions.append((keyword, args.strip()))
    return stages


def shell_commands(run: str) -> list[list[str]]:
    """A RUN's shell commands (split on && and ;), each as argv, its --mount flags dropped."""
    run = re.sub(r"^(--mount=\S+\s+)+", "", run)
    return [shlex.split(part) for part in re.split(r"&&|;", run) if part.strip()]


def pip_commands(stage: Stage, verb: str) -> list[list[str]]:
    return [
        argv
        for run in stage.all("RUN")
        for argv in shell_commands(run)
        if argv[:2] == ["pip", verb] or argv[1:3] == ["pip", verb]  # VAR=value pip ...
    ]


def option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


@cache
def stages_of(image: str) -> list[Stage]:
    return parse_dockerfile((DOCKER / IMAGES[image].dockerfile).read_text())


def final_stage(image: str) -> Stage:
    return stages_of(image)[-1]


# -- pyproject, the lock, the images' Python -------------------------------------------------


@cache
def requirements_module() -> Any:
    spec = importlib.util.spec_from_file_location("docker_requirements", DOCKER / "requirements.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def image_python() -> str:
    """The full Python version of the images: the trainer's pinned python base image."""
    (base,) = {s.base for s in stages_of("trainer")}
    match = re.fullmatch(r"python:(3\.\d+\.\d+)-slim-[a-z]+", base)
    assert match, f"trainer base {base} is not python:X.Y.Z-slim-<debian>"
    return match[1]


@cache
def lock_pins() -> dict[str, str]:
    """requirements.lock evaluated for the images' Python on Linux."""
    full = image_python()
    env = {
        "python_version": full.rsplit(".", 1)[0],
        "python_full_version": full,
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    return requirements_module().locked_versions((ROOT / "requirements.lock").read_text(), env)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_names(image: Image) -> set[str]:
    """Names pyproject declares for the image, read here with tomllib alone."""
    project = pyproject()["project"]
    lines = list(project["dependencies"]) if image.dependencies else []
    for extra in image.extras:
        lines += project["optional-dependencies"][extra]
    return {canonical(re.split(r"[\s\[<>=!~;]", line, maxsplit=1)[0]) for line in lines}


# -- base images -------------------------------------------------------------------------------


def test_bases_are_pinned_to_the_lock():
    py = image_python().rsplit(".", 1)[0]
    pins = lock_pins()
    expected = {
        "trainer": f"python:{image_python()}-slim-bookworm",
        "beam": f"apache/beam_python{py}_sdk:{pins['apache-beam']}",
        "airflow": f"apache/airflow:{pins['apache-airflow']}-python{py}",
    }
    for image, base in expected.items():
        # Builder and runtime share the base: wheels built for one run on the other.
        assert {s.base for s in stages_of(image)} == {base}, image
        assert [s.name for s in stages_of(image)] == ["builder", None], image
    # The lock resolves jax for this Python (its markers split at 3.12).
    assert pins["jax"] and pins["jaxlib"] == pins["jax"]


# -- users -------------------------------------------------------------------------------------


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_final_stage_runs_as_a_numeric_non_root_user(image):
    users = final_stage(image).all("USER")
    assert users, f"{image}: the final stage sets no USER"
    uid, _, _gid = users[-1].partition(":")
    # Numeric: Kubernetes can only verify runAsNonRoot against a numeric user.
    assert uid.isdigit() and int(uid) != 0, f"{image}: USER {users[-1]}"
    runs = " ".join(final_stage(image).all("RUN"))
    assert image == "airflow" or f"useradd --uid {uid}" in runs  # (airflow: the base's user)


def test_trainer_user_is_the_jobset_pods_user():
    from operators.jobset.manifest import TrainingLaunch

    uid = final_stage("trainer").all("USER")[-1].split(":")[0]
    assert TrainingLaunch.__dataclass_fields__["run_as_user"].default == int(uid)


# -- dependency sets ---------------------------------------------------------------------------


def _selection(image: str) -> tuple[tuple[str, ...], bool, str]:
    """What the builder asks docker/requirements.py for, and where it writes the answer."""
    (builder, _) = stages_of(image)
    calls = [run for run in builder.all("RUN") if "docker/requirements.py" in run]
    assert len(calls) == 1, f"{image}: one docker/requirements.py call"
    (part,) = [p for p in re.split(r"&&", calls[0]) if "docker/requirements.py" in p]
    command, _, target = part.partition(">")
    argv = shlex.split(command)
    assert argv[:2] == ["python", "docker/requirements.py"], argv
    assert option(argv, "--lock") == "requirements.lock"
    rest = [a for a in argv[2:] if a not in ("--lock", "requirements.lock")]
    extras = tuple(a for a in rest if not a.startswith("--"))
    return extras, "--dependencies" in rest, target.strip()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_installs_exactly_its_declared_set(image):
    spec = IMAGES[image]
    extras, dependencies, target = _selection(image)
    assert (extras, dependencies) == (spec.extras, spec.dependencies)
    assert target == "/tmp/wheels/requirements.txt"

    # The builder fetches that set, pinned by the lock, and the slipway wheel without deps.
    (builder, runtime) = stages_of(image)
    fetch = [c for c in pip_commands(builder, "wheel") if "--no-deps" not in c]
    assert len(fetch) == 1
    assert option(fetch[0], "--constraint") == "requirements.lock"
    assert option(fetch[0], "--requirement") == target
    (own,) = [c for c in pip_commands(builder, "wheel") if "--no-deps" in c]
    assert own[-1] == "." and own[0].startswith("PIP_CONSTRAINT=") and "requirements.lock" in own[0]

    # The runtime installs exactly those two things, offline, and nothing else.
    installs = pip_commands(runtime, "install")
    assert len(installs) == 2, installs
    deps, wheel = installs
    assert "--no-index" in deps and option(deps, "--requirement") == target
    assert option(deps, "--constraint") == "/tmp/wheels/requirements.lock"
    assert [a for a in deps[2:] if not a.startswith("-") and a not in deps_values(deps)] == []
    assert "--no-deps" in wheel and "--no-index" in wheel
    assert wheel[-1] == "/tmp/wheels/slipway-*.whl"
    assert not pip_commands(runtime, "wheel")

    # And what requirements.py prints for that selection is pyproject's set at the lock's pins.
    module = requirements_module()
    reqs = module.declared(pyproject(), spec.extras, spec.dependencies)
    lines = module.pinned(reqs, lock_pins())
    printed = {canonical(re.split(r"[\[=]", line, maxsplit=1)[0]): line for line in lines}
    assert set(printed) == declared_names(spec)
    for name, line in printed.items():
        assert line.endswith(f"=={lock_pins()[name]}"), line


def deps_values(argv: list[str]) -> set[str]:
    """Values of the options that take one (so they are not taken for requirements)."""
    takes = {"--find-links", "--constraint", "--requirement"}
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in takes}


def test_trainer_gets_jax_with_tpu_support_at_the_locked_jax():
    lines = requirements_module().pinned(
        requirements_module().declared(pyproject(), ("trainer", "tpu")), lock_pins()
    )
    assert f"jax[tpu]=={lock_pins()['jax']}" in lines


def _third_party_imports(package: str) -> dict[str, str]:
    """Top-level modules imported anywhere in ``package`` (lazy imports too) -> a file."""
    found: dict[str, str] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN_PACKAGES | {"__future__"}:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("image", [name for name, spec in IMAGES.items() if spec.packages])
def test_image_code_imports_only_what_its_set_declares(image):
    spec = IMAGES[image]
    declared = declared_names(spec)
    distributions = packages_distributions()
    missing = {}
    for package in spec.packages:
        for module, where in _third_party_imports(package).items():
            dists = {canonical(d) for d in distributions.get(module, [module])}
            if not dists & declared:  # declared directly, not merely pulled in by something
                missing[module] = where
    assert not missing, f"{image}: imported but not declared for the image: {missing}"
    # Production paths are gs://: fsspec needs gcsfs, which nothing imports by name.
    assert "gcsfs" in declared


# -- entrypoints -------------------------------------------------------------------------------


def _entrypoint(image: str) -> tuple[str, ...] | None:
    entries = final_stage(image).all("ENTRYPOINT")
    return tuple(ast.literal_eval(entries[-1])) if entries else None  # exec form only


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_entrypoint(image):
    assert _entrypoint(image) == IMAGES[image].entrypoint


def test_trainer_entrypoints_exist_and_match_the_manifest():
    from operators.jobset.manifest import TRAINER_COMMAND

    assert _entrypoint("trainer") == tuple(TRAINER_COMMAND)
    for module in ("trainer.train", "trainer.evaluate"):
        assert importlib.util.find_spec(module) is not None, module


def test_beam_worker_has_every_stage_module():
    from operators.pipeline.form import STAGES

    for stage in STAGES:
        assert importlib.util.find_spec(f"pipelines.{stage}") is not None, stage
    env = " ".join(final_stage("beam").all("ENV"))
    assert "RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT=1" in env


def test_airflow_image_ships_dags_and_plugins():
    copies = {tuple(c.split()[-2:]) for c in final_stage("airflow").all("COPY")}
    assert copies == {("dags", "/opt/airflow/dags"), ("plugins", "/opt/airflow/plugins")}
    assert (ROOT / "dags" / "slipway_pipeline.py").is_file()
    assert importlib.util.find_spec("operators.beam_stage") is not None


def test_the_platform_image_can_fetch_every_corpus_package():
    """The ``fetch`` task runs in the platform image (a task pod on GKE), which installs no npm
    and whose user cannot refresh apt's package lists: every npm and Debian package must come
    from its registry directly (``registry_path``); pip, the base image's, fetches the rest."""
    from pipelines.corpora.packages import PACKAGES

    commands = [argv for run in final_stage("airflow").all("RUN") for argv in shell_commands(run)]
    assert not [argv for argv in commands if argv[:2] == ["apt-get", "install"]]
    assert {p.client for p in PACKAGES.values()} == {"npm", "apt", "pypi"}
    without_client = [p.name for p in PACKAGES.values() if p.client in ("npm", "apt")]
    assert [n for n in without_client if PACKAGES[n].registry_path is None] == []


@pytest.mark.parametrize("values", ["values.yaml", "values-production.yaml"])
def test_the_platform_image_has_the_lineage_urls_database_driver(values):
    """The chart's lineage URL names a SQLAlchemy driver (``postgresql+psycopg``): the
    platform image must install its module, or every task's lineage write fails on GKE only."""
    import yaml
    from sqlalchemy.dialects import registry
    from sqlalchemy.engine import make_url

    url = yaml.safe_load((ROOT / "charts" / "slipway" / values).read_text())["lineage"]["url"]
    dbapi = registry.load(make_url(url).drivername.replace("+", ".")).import_dbapi()
    distributions = packages_distributions().get(dbapi.__name__.split(".")[0], [])
    assert {canonical(d) for d in distributions} & declared_names(IMAGES["airflow"]), (
        f"{values}: lineage.url's driver module {dbapi.__name__} comes from {distributions}, "
        "which the slipway-airflow image does not declare"
    )


# -- build context -----------------------------------------------------------------------------


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    """(.dockerignore) rules as (negated, regex), Docker's matching: ``*`` within one path
    segment, ``**`` across segments, and a rule on a folder covers everything under it."""
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        for token in re.split(r"(\*\*/|\*\*|\*|\?|\[[^\]]*\])", pattern):
            regex += {
                "**/": "(?:.*/)?",
                "**": ".*",
                "*": "[^/]*",
                "?": "[^/]",
            }.get(token, token if token.startswith("[") else re.escape(token))
        rules.append((negated, re.compile(rf"^{regex}(?:/.*)?$")))
    return rules


def excluded(path: str) -> bool:
    verdict = False
    for negated, rule in _dockerignore():
        if rule.match(path):
            verdict = not negated
    return verdict


@pytest.mark.parametrize(
    "path",
    [
        ".venv/bin/python",
        "data/raw/brown.jsonl.gz",
        "out/steps/ingest-0123/output/manifest.json",
        ".git/HEAD",
        "tests/unit/test_images.py",
        "pipelines/__pycache__/stage.cpython-311.pyc",
        "operators/jobset/__pycache__/preflight.cpython-311.pyc",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/0.17/x",
        "slipway.egg-info/PKG-INFO",
        "charts/slipway/values.yaml",
        ".env",
        "service-account-key.json",
        "docker/trainer.Dockerfile",
    ],
)
def test_build_context_leaves_out(path):
    assert excluded(path)


def test_build_context_has_everything_the_images_copy():
    sources: set[str] = set()
    for image in IMAGES:
        for stage in stages_of(image):
            for copy in stage.all("COPY"):
                args = [a for a in copy.split() if not a.startswith("--")]
                sources.update(args[:-1])
    files = []
    for source in sources:
        path = ROOT / source
        assert path.exists(), source
        files += [path] if path.is_file() else [p for p in path.rglob("*.py")]
    kept = [str(f.relative_to(ROOT)) for f in files if "__pycache__" not in f.parts]
    assert kept and [f for f in kept if excluded(f)] == []


# -- secrets -----------------------------------------------------------------------------------

SECRET_NAME = re.compile(r"(?i)(token|secret|passw|private|credential|api_?key|access_?key|auth)")
SECRET_VALUE = re.compile(
    r"-----BEGIN [A-Z ]*PRIVATE KEY|AKIA[0-9A-Z]{16}|ya29\.|ghp_[A-Za-z0-9]{20}"
)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_no_secrets_in_the_build(image):
    text = (DOCKER / IMAGES[image].dockerfile).read_text()
    assert not SECRET_VALUE.search(text)
    for stage in stages_of(image):
        for keyword in ("ARG", "ENV"):
            for args in stage.all(keyword):
                names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", args) or [args.split()[0]]
                assert not [n for n in names if SECRET_NAME.search(n)], (image, keyword, args)
        # No credentials baked in: GCP identities come from Workload Identity at run time.
        assert "GOOGLE_APPLICATION_CREDENTIALS" not in " ".join(stage.all("ENV"))
        assert not any("secret" in run for run in stage.all("RUN"))  # no --mount=type=secret


# -- docker/requirements.py itself -------------------------------------------------------------


def test_requirements_refuses_a_stale_lock():
    module = requirements_module()
    project = {
        "project": {
            "dependencies": ["numpy>=2"],
            "optional-dependencies": {"x": ["jax[tpu]>=0.10", "jax>=0.10"], "y": ["nope>=1"]},
        }
    }
    lock = (
        "jax==0.10.2 ; python_full_version < '3.12'\njax==0.12.0 ; python_full_version >= '3.12'\n"
    )
    lock += "numpy==1.26.0\n    # via x\n"
    env = {"python_full_version": "3.11.13", "python_version": "3.11"}
    pins = module.locked_versions(lock, env)
    assert pins == {"jax": "0.10.2", "numpy": "1.26.0"}
    assert module.pinned(module.declared(project, ["x"]), pins) == ["jax[tpu]==0.10.2"]
    with pytest.raises(module.LockError, match=re.escape("pins numpy==1.26.0")):
        module.pinned(module.declared(project, [], dependencies=True), pins)
    with pytest.raises(module.LockError, match="does not pin nope"):
        module.pinned(module.declared(project, ["y"]), pins)
    with pytest.raises(KeyError, match="no extra 'z'"):
        module.declared(project, ["z"])


def test_requirements_cli_prints_the_trainer_set(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert requirements_module().main(["trainer", "tpu"]) == 0
    printed = capsys.readouterr().out.split()
    # The declared requirements only (libtpu etc. come pinned through them and the lock).
    assert printed[0] == f"jax[tpu]=={lock_pins()['jax']}"
    assert len(printed) == len(declared_names(IMAGES["trainer"]))
