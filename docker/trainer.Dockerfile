# syntax=docker/dockerfile:1.7
#
# slipway-trainer: the JAX trainer on Cloud TPU. The JobSet manifest runs
# `python -m trainer.train --config <uri>` (also this image's ENTRYPOINT); evaluation runs
# `python -m trainer.evaluate` in the same image.
#
#   docker build -f docker/trainer.Dockerfile -t slipway-trainer:0.1.0 .
#
# Dependencies: exactly pyproject.toml's `trainer` + `tpu` extras (jax[tpu] brings libtpu) at
# requirements.lock's versions, printed by docker/requirements.py; the slipway wheel goes in
# with --no-deps, so nothing else of the project (Airflow, Beam) reaches this image.

# ---- builder: every wheel, resolved once, pinned by the lock --------------------------------
FROM python:3.11.13-slim-bookworm AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY docker/requirements.py docker/requirements.py
# Dependencies before sources: this layer rebuilds only when pyproject.toml or the lock change.
RUN mkdir -p /tmp/wheels \
 && cp requirements.lock /tmp/wheels/requirements.lock \
 && python docker/requirements.py --lock requirements.lock trainer tpu > /tmp/wheels/requirements.txt \
 && pip wheel --wheel-dir /tmp/wheels --constraint requirements.lock --requirement /tmp/wheels/requirements.txt
COPY pipelines pipelines
COPY trainer trainer
COPY tokenstore tokenstore
COPY operators operators
# PIP_CONSTRAINT reaches the isolated build environment too: setuptools comes from the lock.
RUN PIP_CONSTRAINT=/src/requirements.lock pip wheel --no-deps --wheel-dir /tmp/wheels .

# ---- runtime: the same base, no compilers, no caches, no wheel files ------------------------
FROM python:3.11.13-slim-bookworm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Bind-mounted, not copied: the wheels never become a layer of the image.
RUN --mount=type=bind,from=builder,source=/tmp/wheels,target=/tmp/wheels \
    pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        --constraint /tmp/wheels/requirements.lock --requirement /tmp/wheels/requirements.txt \
 && pip install --no-cache-dir --no-index --no-deps /tmp/wheels/slipway-*.whl
# uid/gid 1000: the JobSet pod's securityContext (runAsUser, runAsNonRoot) expects this user.
RUN groupadd --gid 1000 slipway \
 && useradd --uid 1000 --gid 1000 --no-log-init --create-home --shell /usr/sbin/nologin slipway
WORKDIR /home/slipway
USER 1000:1000
ENTRYPOINT ["python", "-m", "trainer.train"]
