#!/bin/sh
# One-off federation bootstrap for docker-compose.yml (the "pki-init" service).
# Idempotent: an existing CA or site key is never replaced, so re-running
# `docker-compose up` keeps every certificate and the training history.
#
# It plays every party of the real flow (docs/pki.md) on one host, in three folders:
#
#   PKI_DIR              the operator's CA folder (ca.key, every certificate, no site
#                        key): mounted by no running service
#   COORDINATOR_PKI_DIR  what the coordinator mounts: ca.crt, crl.pem, its own pair and
#                        the health probe's monitor pair, and NO site identity
#   HOSPITALS_DIR        one folder per hospital (HOSPITALS_DIR/SITE: ca.crt and
#                        sites/SITE.crt/.key); each site's key is made there by
#                        `medfed pki request` and only its CSR is signed by the operator
#
#   COORDINATOR_HOSTS    names in the coordinator certificate (comma-separated): the
#                        name the sites dial and the one the health probe verifies
#   SITES                site ids (space-separated)
#   MONITOR              name of the health probe's monitor certificate
#   PROMETHEUS_PKI_DIR   optional: what the operator's Prometheus mounts to scrape the
#                        coordinator's /metrics over HTTPS (monitor certificates only):
#                        ca.crt and the pair of the monitor "prometheus" (issued once,
#                        `medfed pki issue --monitor prometheus`) as prometheus.crt/.key,
#                        the key readable by the folder's group (Prometheus runs as its
#                        own user in that group, docker-compose.yml); no other key
#   STUDY_IN, STUDY_OUT  optional: the study to serve (STUDY_IN, read-only) written to
#                        STUDY_OUT (the coordinator's --study) with a [[members]] table for
#                        every site certificate the operator issued (`medfed pki members
#                        --study`): a site agent joins only a study that names its members
#                        (policy.allow_open_membership = false, docs/threat-model.md). A
#                        study that lists [[members]] already is served as it is. Written
#                        once: an existing STUDY_OUT is kept (the coordinator's state is
#                        pinned to its SHA-256; a member revoked later stays listed and
#                        is refused by the CRL this script copies). Each hospital
#                        receives it too, as the operator sends it (HOSPITALS_DIR/SITE/
#                        study.toml), for its privacy officer to approve (`medfed site
#                        approve`: compose's approve-SITE jobs).
#   BOOTSTRAP_PKI        1 (default) as above; 0 does nothing (Kubernetes: certificates
#                        come from Secrets made elsewhere; an init container writes the
#                        study's untrained network with the site image's `medfed model
#                        init`)
#
# Each run copies the current crl.pem to the coordinator's folder, so a revocation
# (`medfed pki revoke --dir PKI_DIR ...`) reaches it by re-running this script.
# Production: run `medfed pki` on the operator's offline machine and at each hospital
# instead (docs/deploy.md); the CA key must not live on a volume a service mounts.
set -eu
umask 077
PKI_DIR="${PKI_DIR:-/pki}"
COORDINATOR_PKI_DIR="${COORDINATOR_PKI_DIR:-/coordinator-pki}"
HOSPITALS_DIR="${HOSPITALS_DIR:-/hospitals}"
COORDINATOR_HOSTS="${COORDINATOR_HOSTS:-coordinator}"
SITES="${SITES:-paediatric geriatric rural}"
MONITOR="${MONITOR:-healthcheck}"
BOOTSTRAP_PKI="${BOOTSTRAP_PKI:-1}"

# copy SRC DST: replace DST in one rename (a running coordinator re-reads crl.pem).
copy() {
    cp "$1" "$(dirname "$2")/.$(basename "$2").tmp"
    mv "$(dirname "$2")/.$(basename "$2").tmp" "$2"
}

bootstrap_pki() {
if [ ! -f "$PKI_DIR/ca.crt" ]; then
    medfed pki init --dir "$PKI_DIR"
    medfed pki issue --dir "$PKI_DIR" --coordinator "$COORDINATOR_HOSTS"
    # The coordinator accepts mutual TLS only, so its health probe needs a client
    # certificate: a monitor's, which may call Health and nothing that a site may.
    medfed pki issue --dir "$PKI_DIR" --monitor "$MONITOR"
else
    echo "bootstrap: $PKI_DIR/ca.crt exists, keeping the PKI"
fi

# Each hospital: its own key and CSR (at the hospital), signed by the operator.
for site in $SITES; do
    hospital="$HOSPITALS_DIR/$site"
    if [ ! -f "$hospital/sites/$site.key" ]; then
        medfed pki request --site "$site" --out "$hospital/sites"
        medfed pki sign --dir "$PKI_DIR" --csr "$hospital/sites/$site.csr"
        copy "$PKI_DIR/sites/$site.crt" "$hospital/sites/$site.crt"
        rm -f "$hospital/sites/$site.csr"
    fi
    copy "$PKI_DIR/ca.crt" "$hospital/ca.crt"
done

# The coordinator's folder: never a site key, never the CA key.
mkdir -p "$COORDINATOR_PKI_DIR/monitors"
for file in ca.crt crl.pem coordinator.crt coordinator.key \
            "monitors/$MONITOR.crt" "monitors/$MONITOR.key"; do
    copy "$PKI_DIR/$file" "$COORDINATOR_PKI_DIR/$file"
done

# The operator's Prometheus: a monitor identity of its own (a revoked one is re-issued
# by `medfed pki issue --force`, then copied here by the next run).
if [ -n "${PROMETHEUS_PKI_DIR:-}" ]; then
    if [ ! -f "$PKI_DIR/monitors/prometheus.crt" ]; then
        medfed pki issue --dir "$PKI_DIR" --monitor prometheus
    fi
    copy "$PKI_DIR/ca.crt" "$PROMETHEUS_PKI_DIR/ca.crt"
    copy "$PKI_DIR/monitors/prometheus.crt" "$PROMETHEUS_PKI_DIR/prometheus.crt"
    copy "$PKI_DIR/monitors/prometheus.key" "$PROMETHEUS_PKI_DIR/prometheus.key"
    chmod 0644 "$PROMETHEUS_PKI_DIR/ca.crt" "$PROMETHEUS_PKI_DIR/prometheus.crt"
    chmod 0640 "$PROMETHEUS_PKI_DIR/prometheus.key"
    chmod 0750 "$PROMETHEUS_PKI_DIR"
fi

if [ -n "${STUDY_IN:-}" ] && [ -f "$STUDY_OUT" ]; then
    echo "bootstrap: $STUDY_OUT exists, keeping the study"
elif [ -n "${STUDY_IN:-}" ]; then
    mkdir -p "$(dirname "$STUDY_OUT")"
    study_tmp="$(dirname "$STUDY_OUT")/.$(basename "$STUDY_OUT").tmp"
    if grep -q '^\[\[members\]\]' "$STUDY_IN"; then
        cp "$STUDY_IN" "$study_tmp"
    else
        { cat "$STUDY_IN"; echo; medfed pki members --dir "$PKI_DIR" --study; } > "$study_tmp"
    fi
    chmod 644 "$study_tmp"
    mv "$study_tmp" "$STUDY_OUT"
    echo "bootstrap: $STUDY_OUT is $STUDY_IN with its members"
fi
if [ -n "${STUDY_IN:-}" ]; then
    # What the operator sends each hospital to approve: the served study, byte for byte.
    for site in $SITES; do
        copy "$STUDY_OUT" "$HOSPITALS_DIR/$site/study.toml"
        chmod 644 "$HOSPITALS_DIR/$site/study.toml"
    done
fi
}

if [ "$BOOTSTRAP_PKI" = 1 ]; then
    bootstrap_pki
fi
