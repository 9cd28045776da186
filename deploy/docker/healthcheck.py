#!/usr/bin/env python3
"""Container health probe for medfed (Docker HEALTHCHECK, Kubernetes exec probes).

    healthcheck.py grpc   # coordinator: grpc.health.v1 Check over mutual TLS
    healthcheck.py http   # site agent: its Prometheus /metrics endpoint answers

Why a separate script: the coordinator accepts only mutual-TLS connections (there is
no plaintext port to forget), so even a health probe must present a certificate issued
by the federation CA for TLS client authentication. The coordinator's own certificate
is for server authentication only, so the image is given a *monitor* certificate
(`medfed pki issue --monitor healthcheck`, see docs/deploy.md): it may call Health and
read-only status and nothing a site may, so the probe is no hospital. A site agent
has no inbound gRPC port at all (outbound only), so its liveness is its /metrics port.

The probe dials 127.0.0.1 inside the container, but the coordinator's certificate names
its public host(s). Unless --server-name says otherwise, the probe reads the mounted
coordinator certificate (--server-cert) and verifies the server against a name that is
in it, so the check passes exactly when the real server presents that certificate.

Settings come from flags or MEDFED_HEALTH_* environment variables, so that the
HEALTHCHECK line stays short. Exit status 0 = healthy, 1 = unhealthy (Docker's rule).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request
from pathlib import Path


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"MEDFED_HEALTH_{name}", default)


def check_grpc(args: argparse.Namespace) -> str:
    """Health.Check over mutual TLS; returns a problem description, or "" if SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.ca).read_bytes(),
        private_key=Path(args.key).read_bytes(),
        certificate_chain=Path(args.cert).read_bytes(),
    )
    options = []
    server_name = args.server_name or name_in_certificate(args.target, args.server_cert)
    if server_name:
        # Dialling 127.0.0.1 inside the container while the certificate names the
        # public host: verify the certificate against that name instead.
        options.append(("grpc.ssl_target_name_override", server_name))
    with grpc.secure_channel(args.target, credentials, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        return f"status {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"
    return ""


def certificate_names(path: str) -> list[str]:
    """DNS names and IP addresses (as text) in a certificate's subjectAltName."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    dns = [name.lower() for name in san.get_values_for_type(x509.DNSName)]
    return dns + [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]


def name_in_certificate(target: str, server_cert: str | None) -> str:
    """The name to verify the server against: "" if the target host is in the mounted
    coordinator certificate (or there is none), else the certificate's first name."""
    if not server_cert or not Path(server_cert).is_file():
        return ""
    names = certificate_names(server_cert)
    host = target.rsplit(":", 1)[0].strip("[]").lower()
    if not names or host in names:
        return ""
    return names[0]


def check_http(args: argparse.Namespace) -> str:
    """GET the metrics URL; healthy when it answers 200 with a medfed metric in it."""
    if not args.url.startswith(("http://", "https://")):
        return f"not an http(s) URL: {args.url}"
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as response:  # noqa: S310
            body = response.read().decode("utf-8", "replace")
            status = response.status
    except OSError as exc:
        return f"{args.url}: {exc}"
    if status != 200:
        return f"{args.url}: HTTP {status}"
    if args.expect not in body:
        return f"{args.url}: no {args.expect} metric in the response"
    return ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rpc = sub.add_parser("grpc", help="grpc.health.v1 Check over mutual TLS (coordinator)")
    rpc.add_argument("--target", default=_env("TARGET", "127.0.0.1:7443"))
    rpc.add_argument("--ca", default=_env("CA", "/pki/ca.crt"))
    rpc.add_argument("--cert", default=_env("CERT", "/pki/monitors/healthcheck.crt"),
                     help="monitor certificate (medfed pki issue --monitor NAME)")
    rpc.add_argument("--key", default=_env("KEY", "/pki/monitors/healthcheck.key"))
    rpc.add_argument("--server-name", default=_env("SERVER_NAME"),
                     help="name to verify the coordinator certificate against "
                          "(default: a name from --server-cert)")
    rpc.add_argument("--server-cert", default=_env("SERVER_CERT", "/pki/coordinator.crt"),
                     help="the coordinator's certificate, to pick a name it carries")
    rpc.add_argument("--service", default=_env("SERVICE", ""),
                     help='health service name ("" = the whole server)')
    rpc.add_argument("--timeout", type=float, default=float(_env("TIMEOUT", "5") or 5))
    rpc.set_defaults(check=check_grpc)
    http = sub.add_parser("http", help="the /metrics endpoint answers (site agent)")
    http.add_argument("--url", default=_env("URL", "http://127.0.0.1:9465/metrics"))
    http.add_argument("--expect", default=_env("EXPECT", "medfed_"),
                      help="text the response must contain")
    http.add_argument("--timeout", type=float, default=float(_env("TIMEOUT", "5") or 5))
    http.set_defaults(check=check_http)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        problem = args.check(args)
    except OSError as exc:  # unreadable certificate files and friends
        problem = str(exc)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    print("healthy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
