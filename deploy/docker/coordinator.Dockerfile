# syntax=docker/dockerfile:1
# medfed coordinator (CPU). From the repository root:
#   make images                         (both images, tags medfed-*:VERSION)
#   docker build -f deploy/docker/coordinator.Dockerfile -t medfed-coordinator:0.1.0 .
# Build args (all optional): BASE_IMAGE, TORCH_INDEX, WHEELS, VERSION, as in
# site_agent.Dockerfile. Every package comes from requirements/coordinator.lock, pinned
# with SHA-256 hashes. The image carries the coordinator and common/ only: no site agent,
# no bench code (tests/deploy/test_role_images.py runs the coordinator with both absent).
# torch, opacus and monai are in this image because the coordinator builds a study's
# untrained initial model (common.models.build) and the privacy accountants use opacus's
# (common.privacy.accountant).
# Mount at run time (nothing secret is baked into the image):
#   /pki     ca.crt, crl.pem, coordinator.crt/.key, monitors/healthcheck.crt/.key
#            (read-only; never a site key, never ca.key)
#   /config  coordinator.toml (deploy/config/coordinator.toml) and study.toml  (read-only)
#   /state   state database, checkpoints, federation ledger                      (read-write)
# Ports: 7443 mTLS gRPC (public), 9464 Prometheus /metrics (internal network only).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=deploy/docker/wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/medfed
COPY ${WHEELS} /wheels
COPY requirements/coordinator.lock /src/requirements/coordinator.lock
RUN /opt/medfed/bin/pip install --require-hashes --find-links /wheels \
        ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /src/requirements/coordinator.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY coordinator ./coordinator
RUN /opt/medfed/bin/pip install --no-deps --no-build-isolation . \
    && cd / && /opt/medfed/bin/python -c "import coordinator.cli, common.cli" \
    && /opt/medfed/bin/python -c "import importlib.util as u, sys; \
sys.exit(any(u.find_spec(m) for m in ('site_agent', 'bench', 'demo')))" \
    && /opt/medfed/bin/medfed privacy --help >/dev/null \
    && /opt/medfed/bin/medfed query run --help >/dev/null

FROM ${BASE_IMAGE}
ARG MEDFED_UID=10001
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="medfed-coordinator" \
      org.opencontainers.image.version="${VERSION}"
RUN groupadd --system --gid "${MEDFED_UID}" medfed \
    && useradd --system --uid "${MEDFED_UID}" --gid medfed --home-dir /nonexistent \
       --no-create-home --shell /usr/sbin/nologin medfed \
    && mkdir -p /pki /config /state /coordinator-pki /hospitals \
    && chown medfed:medfed /pki /state /coordinator-pki /hospitals
COPY --from=build /opt/medfed /opt/medfed
COPY deploy/docker/healthcheck.py /usr/local/bin/medfed-healthcheck
COPY deploy/docker/bootstrap.sh /usr/local/bin/medfed-bootstrap
RUN chmod 0755 /usr/local/bin/medfed-healthcheck /usr/local/bin/medfed-bootstrap
ENV PATH=/opt/medfed/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MEDFED_HEALTH_TARGET=127.0.0.1:7443 \
    MEDFED_HEALTH_CA=/pki/ca.crt \
    MEDFED_HEALTH_CERT=/pki/monitors/healthcheck.crt \
    MEDFED_HEALTH_KEY=/pki/monitors/healthcheck.key \
    MEDFED_HEALTH_SERVER_CERT=/pki/coordinator.crt
USER medfed
WORKDIR /state
VOLUME ["/state"]
EXPOSE 7443 9464
# grpc.health.v1 over mutual TLS with the probe's monitor certificate (the coordinator
# accepts nothing else), verified against a name in coordinator.crt; see healthcheck.py.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "/usr/local/bin/medfed-healthcheck", "grpc"]
ENTRYPOINT ["medfed", "coordinator", "serve"]
CMD ["--config", "/config/coordinator.toml"]
