# syntax=docker/dockerfile:1
# medfed site agent, CPU variant (GPU: site_agent.cuda.Dockerfile). From the repo root:
#   docker build -f deploy/docker/site_agent.Dockerfile -t medfed-site-agent .
# Mount at run time (nothing secret is baked into the image):
#   /pki     ca.crt and sites/SITE_ID.crt/.key (key made here by `medfed pki request`,
#            certificate signed by the operator; key mode 0600)                (read-only)
#   /config  site.toml (deploy/config/site.toml)                             (read-only)
#   /data    this hospital's CSV/Parquet records                             (read-only)
#   /state   the privacy ledger (authoritative for this site: back it up)   (read-write)
# Network: outbound only (to the coordinator's 7443); 9465 serves /metrics to the
# hospital's internal monitoring.

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
