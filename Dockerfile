# syntax=docker/dockerfile:1.7
#
# ec-cache server image: the `app` package (distribution `ec-cache-server`) and its
# locked runtime dependencies (requirements.lock) only. No torch, no compiler, no SDK.
#
#   docker build -t ec-cache:0.1.0 .
#   docker run --rm -p 127.0.0.1:8080:8080 -v ec-data:/data \
#     -e EC_ANONYMOUS=read-write ec-cache:0.1.0
#
# Configuration is the server's own EC_* environment (see docs/deploy.md); the image
# only sets EC_HOST (0.0.0.0: all interfaces), EC_PORT (8080, the server's default
# too) and EC_DATA_DIR (/data, a volume).
# Listening beyond loopback, the server refuses to start without tokens
# (EC_AUTH_TOKENS) or an explicit EC_ANONYMOUS, as above.

# Pinned by tag (Python 3.11 on Debian 12). To pin by digest as well, build with
#   --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# --------------------------------------------------------------------------- builder
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src

# Only what building the server distribution needs (see .dockerignore).
COPY pyproject.toml README.md requirements.lock ./
COPY app ./app
COPY deploy/docker/server-wheels.sh deploy/docker/build-backend.lock ./deploy/docker/

# The locked wheels (hash-checked, binary only) and the server's own wheel (built by
# the setuptools of deploy/docker/build-backend.lock, hash-checked too), with the
# lock and the install script (tests/deploy/test_image_install.py runs the same
# script). Nothing from this stage but /wheels reaches the final image.
RUN sh deploy/docker/server-wheels.sh build /wheels

# ------------------------------------------------------------------------------ test
# Not part of the server image: the S3 integration suite, run against MinIO by
# `docker compose --profile test run --rm s3-tests` (see docker-compose.yml).
# BuildKit builds this stage only when it is asked for (`--target test`).
FROM builder AS test
# The test extra's version ranges live in pyproject.toml (the project's own pins);
# this stage is never shipped, so DL3013 (pin every pip package here) does not apply.
# hadolint ignore=DL3013
RUN sh /wheels/server-wheels.sh install /wheels \
 && python -m pip install ".[test]"
COPY testkit ./testkit
COPY tests ./tests
ENTRYPOINT ["python", "-m", "pytest"]
CMD ["-q", "tests/s3"]

# ----------------------------------------------------------------------------- final
FROM ${PYTHON_IMAGE} AS runtime

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG UID=10001
ARG GID=10001

LABEL org.opencontainers.image.title="ec-cache" \
      org.opencontainers.image.description="Shared HTTP cache for multimodal encoder outputs (disk tier + S3 persistence)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="ec-cache" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    EC_HOST=0.0.0.0 \
    EC_PORT=8080 \
    EC_DATA_DIR=/data

# Fixed, unprivileged identity: the Helm chart's securityContext and fsGroup use the
# same numbers, so volumes mounted at /data are writable without running as root.
RUN groupadd --system --gid "${GID}" ec \
 && useradd --system --uid "${UID}" --gid ec --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin ec \
 && mkdir -p /data \
 && chown "${UID}:${GID}" /data \
 && chmod 0750 /data

# Install from the builder's wheels only (no index, hashes of requirements.lock),
# then check the result (imports, no torch): deploy/docker/server-wheels.sh. The
# wheels are bind-mounted, so they never become a layer of this image.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    sh /wheels/server-wheels.sh install /wheels

COPY --chmod=0755 deploy/docker/healthcheck.py /usr/local/bin/ec-cache-healthcheck

USER ${UID}:${GID}
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8080

# Liveness only (/healthz); readiness (/readyz) is for orchestrators that route traffic.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["ec-cache-healthcheck"]

# uvicorn installs its own SIGTERM/SIGINT handlers (graceful shutdown: stop accepting,
# drain in-flight requests), so python can be PID 1 without an init shim; the server
# starts no child processes to reap. Use `docker run --init` if you want tini anyway.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "app"]
