"""Client credentials from a `medfed pki` folder, as the tests' sites and monitors dial
with them (the product's sites and monitors name their three files explicitly)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import grpc

from common.protocol import tls


def site_credentials(
    pki_dir: Path, site_id: str, *, now: dt.datetime | None = None
) -> grpc.ChannelCredentials:
    return tls.channel_credentials_from_files(tls.TlsFiles.for_site(pki_dir, site_id), now=now)


def monitor_credentials(pki_dir: Path, name: str) -> grpc.ChannelCredentials:
    return tls.channel_credentials_from_files(tls.TlsFiles.for_monitor(pki_dir, name))
