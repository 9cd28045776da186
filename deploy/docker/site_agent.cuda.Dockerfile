# syntax=docker/dockerfile:1
# medfed site agent, CUDA variant. From the repo root:
#   docker build -f deploy/docker/site_agent.cuda.Dockerfile -t medfed-site-agent:0.1.0-cuda .
#   docker run --gpus all ... medfed-site-agent:0.1.0-cuda   (NVIDIA Container Toolkit on the host)
# Same volumes, ports and health check as site_agent.Dockerfile; set
# training.device = "cuda" (or "auto") in site.toml.
#
# Base: NVIDIA's CUDA runtime image (CUDA user-space libraries matched to the driver
# range the NVIDIA Container Toolkit expects). Python 3.11 is Ubuntu 22.04's own
# python3.11 package (no third-party apt source); the torch wheel brings cuDNN/cuBLAS.
# The venv is built and run with the same /usr/bin/python3.11, so it copies over as is.
# Build args (all optional):
#   CUDA_IMAGE   the CUDA runtime base image          (nvidia/cuda:12.8.1-runtime-ubuntu22.04)
#   TORCH_INDEX  index serving torch==2.13.0 for that CUDA (a mirror)   (PyTorch's cu128)
#   WHEELS       folder in the build context with wheels to install from first
#                (air-gapped builds)                                 (deploy/docker/wheels)
#   VERSION      the version label                                   (0.1.0)
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04
# PyTorch wheel index matching the CUDA major/minor of the base image.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX
ARG WHEELS=deploy/docker/wheels
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3.11 -m venv /opt/medfed
COPY ${WHEELS} /wheels
RUN /opt/medfed/bin/pip install --find-links /wheels torch==2.13.0 --index-url "${TORCH_INDEX}"
# Every other package from requirements/site.lock, pinned with its SHA-256 hash; the
# lock's CPU torch entry is left out (the CUDA torch is installed above), as `make` does.
COPY requirements/site.lock /src/requirements/site.lock
RUN sed '/^torch==/,/^[a-z]/{/^torch==/d;/^ /d;}' /src/requirements/site.lock \
        > /src/requirements/site-without-torch.lock \
    && /opt/medfed/bin/pip install --require-hashes --find-links /wheels \
        -r /src/requirements/site-without-torch.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY site_agent ./site_agent
# The site agent only (no coordinator or bench code), as in site_agent.Dockerfile.
RUN /opt/medfed/bin/pip install --no-deps --no-build-isolation . \
    && cd / && /opt/medfed/bin/python -c "import site_agent.cli, common.commands.cli" \
    && /opt/medfed/bin/python -c "import importlib.util as u, sys; \
sys.exit(any(u.find_spec(m) for m in ('coordinator', 'bench', 'demo')))"

FROM ${CUDA_IMAGE}
ARG MEDFED_UID=10001
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="medfed-site-agent" \
      org.opencontainers.image.version="${VERSION}"
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid "${MEDFED_UID}" medfed \
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
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    MEDFED_HEALTH_URL=http://127.0.0.1:9465/metrics \
    MEDFED_HEALTH_EXPECT=medfed_site_
USER medfed
WORKDIR /state
VOLUME ["/state"]
EXPOSE 9465
HEALTHCHECK --interval=30s --timeout=10s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/medfed-healthcheck", "http"]
ENTRYPOINT ["medfed", "site", "run"]
CMD ["--config", "/config/site.toml"]
