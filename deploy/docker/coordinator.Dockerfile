# syntax=docker/dockerfile:1
# medfed coordinator (CPU). From the repository root:
#   make images                         (both images, tags medfed-*:VERSION)
#   docker build -f deploy/docker/coordinator.Dockerfile -t medfed-coordinator:0.1.0 .
# Build args (all optional): BASE_IMAGE, TORCH_INDEX, WHEELS, VERSION, as in
# site_agent.Dockerfile. Every package comes from requirements/coordinator.lock, pinned
# with SHA-256 hashes. The image carries the coordinator and common/ only: no site agent,
# no bench code, and no torch, Opacus or MONAI (tests/deploy/test_role_images.py runs the
# coordinator with all of them absent). The control plane works on flat vectors and the
# accountants are numpy/scipy; round 1's untrained network is the one file the site
# image's `medfed model init --study study.toml --out initial-model.safetensors` writes,
# passed as --initial-model (docker-compose.yml's model-init, the Deployment's init
# container). TORCH_INDEX is accepted and unused (`make images` passes it to both).
# Mount at run time (nothing secret is baked into the image):
#   /pki     ca.crt, crl.pem, coordinator.crt/.key, monitors/healthcheck.crt/.key
#            (read-only; never a site key, never ca.key)
#   /study   the served study.toml and its initial-model.safetensors (compose's pki-init
#            and model-init write them; read-only)
#   /config  coordinator.toml (deploy/config/coordinator.toml) and study.toml  (read-only)
#   /state   state database, checkpoints, federation ledger                      (read-write)
# pip, setuptools and the packages' own test suites are removed from the venv after the
# install (about 75 MB); the accountants are run once at build time to show that what is
# left computes (PRV, PLD, RDP).
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
        -r /src/requirements/coordinator.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY coordinator ./coordinator
RUN /opt/medfed/bin/pip install --no-deps --no-build-isolation . \
    && /opt/medfed/bin/python -m pip uninstall -q -y pip setuptools \
    && find /opt/medfed -depth -type d -name tests -exec rm -rf {} + \
    && cd / && /opt/medfed/bin/python -c "import coordinator.cli, common.commands.cli" \
    && /opt/medfed/bin/python -c "import importlib.util as u, sys; \
sys.exit(any(u.find_spec(m) for m in \
    ('site_agent', 'bench', 'demo', 'torch', 'opacus', 'monai')))" \
    && /opt/medfed/bin/medfed privacy --help >/dev/null \
    && /opt/medfed/bin/medfed query run --help >/dev/null \
    && /opt/medfed/bin/python -c "from common.privacy.accountant import account; \
from common.privacy.mechanisms import Gaussian, Segment; \
history = [Segment(noise_multiplier=1.0, sample_rate=0.01, steps=100), Gaussian(noise_std=5.0, l2_sensitivity=1.0)]; \
assert all(r.accountant == a and 0 < r.epsilon < 10 for a in ('prv', 'pld', 'rdp') \
           for r in [account(history, delta=1e-5, accountant=a)])"

FROM ${BASE_IMAGE}
ARG MEDFED_UID=10001
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="medfed-coordinator" \
      org.opencontainers.image.version="${VERSION}"
RUN groupadd --system --gid "${MEDFED_UID}" medfed \
    && useradd --system --uid "${MEDFED_UID}" --gid medfed --home-dir /nonexistent \
       --no-create-home --shell /usr/sbin/nologin medfed \
    && mkdir -p /pki /config /state /study /coordinator-pki /coordinator-study /hospitals \
       /prometheus-pki \
    && chown medfed:medfed /pki /state /study /coordinator-pki /coordinator-study /hospitals \
       /prometheus-pki
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
