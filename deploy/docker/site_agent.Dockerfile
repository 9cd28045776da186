# syntax=docker/dockerfile:1
# medfed site agent, CPU variant (GPU: site_agent.cuda.Dockerfile). From the repo root:
#   make images                         (both images, tags medfed-*:VERSION)
#   docker build -f deploy/docker/site_agent.Dockerfile -t medfed-site-agent:0.1.0 .
# Build args (all optional):
#   BASE_IMAGE   Python 3.11 base image                       (python:3.11-slim)
#   TORCH_INDEX  index serving torch==2.13.0+cpu (a mirror; "" = none, e.g. with
#                WHEELS or a pip.conf that finds it)          (PyTorch's CPU index)
#   WHEELS       folder in the build context with wheels to install from first
#                (air-gapped builds: `pip download` them elsewhere)  (deploy/docker/wheels)
#   VERSION      the version label                           (0.1.0)
# Every package comes from requirements/site.lock, pinned with SHA-256 hashes: a
# wheel whose hash differs is refused, whichever index or folder served it.
# The image carries the site agent and common/ only: no coordinator, no bench code.
# Mount at run time (nothing secret is baked into the image):
#   /pki     ca.crt and sites/SITE_ID.crt/.key (key made here by `medfed pki request`,
#            certificate signed by the operator; key mode 0600)                (read-only)
#   /config  site.toml (deploy/config/site.toml) and the study file          (read-only)
#   /data    this hospital's CSV/Parquet records or images                   (read-only)
#   /state   the privacy ledger (authoritative for this site: back it up)   (read-write)
# Network: outbound only (to the coordinator's 7443); 9465 serves /metrics to the
# hospital's internal monitoring.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=deploy/docker/wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/medfed
COPY ${WHEELS} /wheels
COPY requirements/site.lock /src/requirements/site.lock
RUN /opt/medfed/bin/pip install --require-hashes --find-links /wheels \
        ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /src/requirements/site.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY site_agent ./site_agent
RUN /opt/medfed/bin/pip install --no-deps --no-build-isolation . \
    && cd / && /opt/medfed/bin/python -c "import site_agent.cli, common.commands.cli" \
    && /opt/medfed/bin/python -c "import importlib.util as u, sys; \
sys.exit(any(u.find_spec(m) for m in ('coordinator', 'bench', 'demo')))" \
    && /opt/medfed/bin/medfed site run --help >/dev/null

FROM ${BASE_IMAGE}
ARG MEDFED_UID=10001
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="medfed-site-agent" \
      org.opencontainers.image.version="${VERSION}"
RUN groupadd --system --gid "${MEDFED_UID}" medfed \
    && useradd --system --uid "${MEDFED_UID}" --gid medfed --home-dir /nonexistent \
       --no-create-home --shell /usr/sbin/nologin medfed \
    && mkdir -p /pki /config /data /state \
    && chown medfed:medfed /state
COPY --from=build /opt/medfed /opt/medfed
COPY deploy/docker/healthcheck.py /usr/local/bin/medfed-healthcheck
RUN chmod 0755 /usr/local/bin/medfed-healthcheck
ENV PATH=/opt/medfed/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MEDFED_HEALTH_URL=http://127.0.0.1:9465/metrics \
    MEDFED_HEALTH_EXPECT=medfed_site_
USER medfed
WORKDIR /state
VOLUME ["/state"]
EXPOSE 9465
# A site agent has no inbound gRPC port (outbound only): its /metrics port is its pulse.
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/medfed-healthcheck", "http"]
ENTRYPOINT ["medfed", "site", "run"]
CMD ["--config", "/config/site.toml"]
