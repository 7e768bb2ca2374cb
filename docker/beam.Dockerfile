# syntax=docker/dockerfile:1.7
#
# slipway-beam: the Dataflow custom SDK container (the `sdk_container_image` of every Beam
# stage run with DataflowRunner). Workers import `pipelines` and `tokenstore` from here, so
# no --setup_file or requirements are staged per job.
#
#   docker build -f docker/beam.Dockerfile -t slipway-beam:0.1.0 .
#
# The base is Beam's own SDK image at requirements.lock's apache-beam version and the image's
# Python: the launcher (Airflow worker) and the workers must run the same SDK. On top of it,
# exactly pyproject.toml's `beam` extra at the lock's versions (docker/requirements.py) and
# the slipway wheel with --no-deps.

# ---- builder --------------------------------------------------------------------------------
FROM apache/beam_python3.11_sdk:2.77.0 AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY docker/requirements.py docker/requirements.py
RUN mkdir -p /tmp/wheels \
 && cp requirements.lock /tmp/wheels/requirements.lock \
 && python docker/requirements.py --lock requirements.lock beam > /tmp/wheels/requirements.txt \
 && pip wheel --wheel-dir /tmp/wheels --constraint requirements.lock --requirement /tmp/wheels/requirements.txt
COPY pipelines pipelines
COPY trainer trainer
COPY tokenstore tokenstore
COPY operators operators
RUN PIP_CONSTRAINT=/src/requirements.lock pip wheel --no-deps --wheel-dir /tmp/wheels .

# ---- runtime --------------------------------------------------------------------------------
FROM apache/beam_python3.11_sdk:2.77.0
# Everything is preinstalled: the boot program must not build a virtualenv (and pip-install
# into it) on every worker start.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    RUN_PYTHON_SDK_IN_DEFAULT_ENVIRONMENT=1
RUN --mount=type=bind,from=builder,source=/tmp/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        --constraint /tmp/wheels/requirements.lock --requirement /tmp/wheels/requirements.txt \
 && pip install --no-cache-dir --no-index --no-deps /tmp/wheels/slipway-*.whl
RUN groupadd --gid 1000 slipway \
 && useradd --uid 1000 --gid 1000 --no-log-init --create-home --shell /usr/sbin/nologin slipway
USER 1000:1000
# Beam's boot program starts the SDK harness; Dataflow requires it as the entrypoint.
ENTRYPOINT ["/opt/apache/beam/boot"]
