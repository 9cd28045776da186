# syntax=docker/dockerfile:1
# medfed coordinator (CPU). Build from the repository root:
#   docker build -f deploy/docker/coordinator.Dockerfile -t medfed-coordinator .
# Mount at run time (nothing secret is baked into the image):
#   /pki     ca.crt, crl.pem, coordinator.crt/.key, monitors/healthcheck.crt/.key
#            (read-only; never a site key, never ca.key)
#   /config  coordinator.toml (deploy/config/coordinator.toml)                  (read-only)
#   /state   state database, checkpoints, federation ledger                      (read-write)
# Ports: 7443 mTLS gRPC (public), 9464 Prometheus /metrics (internal network only).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/medfed
# torch first, pinned, from the CPU index: the default index pulls gigabytes of CUDA.
RUN /opt/medfed/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY coordinator ./coordinator
COPY site_agent ./site_agent
COPY bench ./bench
RUN /opt/medfed/bin/pip install .

FROM python:3.11-slim
ARG MEDFED_UID=10001
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
