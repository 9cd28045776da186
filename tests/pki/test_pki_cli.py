"""`medfed pki` end to end, as real processes on a real directory."""

from __future__ import annotations

import datetime as dt
import stat
import subprocess
import sys
from pathlib import Path

from common.protocol import pki

# `python -m common.commands.pki` registers exactly what the `medfed` entry point registers
# for `pki` (the same `register`), without loading the other plug-ins.
MEDFED = [sys.executable, "-m", "common.commands.pki"]


def medfed(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MEDFED, *map(str, args)], capture_output=True, text=True, timeout=60, check=False
    )


def test_full_lifecycle(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    init = medfed("pki", "init", "--dir", d, "--algorithm", "ed25519")
    assert init.returncode == 0, init.stderr
    coordinator = medfed("pki", "issue", "--dir", d, "--coordinator", "127.0.0.1,fl.example.org")
    assert coordinator.returncode == 0, coordinator.stderr
    site = medfed("pki", "issue", "--dir", d, "--site", "st-marys", "--validity-days", "90")
    assert site.returncode == 0, site.stderr
    for key in (d / "ca.key", d / "coordinator.key", d / "sites/st-marys.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600

    cert = pki.load_certificate(d / "sites/st-marys.crt")
    assert pki.site_id_from_certificate(cert) == "st-marys"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=90) <= lifetime <= dt.timedelta(days=90, minutes=10)

    listed = medfed("pki", "list", "--dir", d)
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if "CN=st-marys" in line)
    assert row.split()[-1] == "no"
    assert f"{cert.serial_number:x}" in row

    revoke = medfed("pki", "revoke", "--dir", d, "--site", "st-marys")
    assert revoke.returncode == 0, revoke.stderr
    assert cert.serial_number in pki.revoked_serials(d)
    listed = medfed("pki", "list", "--dir", d)
    row = next(line for line in listed.stdout.splitlines() if "CN=st-marys" in line)
    assert row.split()[-1] == "yes"


def test_refuses_overwrite_and_force_moves_aside(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    assert medfed("pki", "init", "--dir", d).returncode == 0
    assert medfed("pki", "issue", "--dir", d, "--site", "h1").returncode == 0
    key_before = (d / "sites/h1.key").read_bytes()

    again = medfed("pki", "issue", "--dir", d, "--site", "h1")
    assert again.returncode == 2
    assert again.stderr.startswith("medfed: error:")
    assert "--force" in again.stderr
    assert "Traceback" not in again.stderr
    assert (d / "sites/h1.key").read_bytes() == key_before

    reinit = medfed("pki", "init", "--dir", d)
    assert reinit.returncode == 2 and "refusing to overwrite" in reinit.stderr

    forced = medfed("pki", "issue", "--dir", d, "--site", "h1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert (d / "sites/h1.key").read_bytes() != key_before
    assert key_before in [p.read_bytes() for p in (d / "replaced").iterdir()]


def test_errors_are_one_clean_line(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    missing = medfed("pki", "issue", "--dir", d, "--site", "h1")
    assert missing.returncode == 2
    assert "ca.crt does not exist" in missing.stderr
    assert medfed("pki", "init", "--dir", d).returncode == 0
    bad = medfed("pki", "issue", "--dir", d, "--site", "Bad Site")
    assert bad.returncode == 2
    assert "site_id" in bad.stderr and "Traceback" not in bad.stderr
    unknown = medfed("pki", "revoke", "--dir", d, "--site", "ghost")
    assert unknown.returncode == 2 and "no certificate" in unknown.stderr
    # Ed25519 leaves cannot do gRPC TLS, so `issue` does not offer them.
    ed = medfed("pki", "issue", "--dir", d, "--site", "h1", "--algorithm", "ed25519")
    assert ed.returncode != 0
    assert not (d / "sites/h1.key").exists()


def test_warns_within_30_days_of_expiry(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    assert medfed("pki", "init", "--dir", d).returncode == 0
    short = medfed("pki", "issue", "--dir", d, "--site", "short", "--validity-days", "10")
    assert short.returncode == 0
    assert "warning:" in short.stderr and "short.crt expires in" in short.stderr
    long = medfed("pki", "issue", "--dir", d, "--site", "long")
    assert "warning" not in long.stderr
    listed = medfed("pki", "list", "--dir", d)
    assert "short.crt expires in" in listed.stderr
    assert "long.crt" not in listed.stderr


def test_crl_refresh_command(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    assert medfed("pki", "init", "--dir", d).returncode == 0
    ca = pki.load_ca(d)
    before = pki.load_crl(d / "crl.pem", ca).next_update_utc
    refreshed = medfed("pki", "crl", "--dir", d, "--crl-validity-days", "90")
    assert refreshed.returncode == 0, refreshed.stderr
    after = pki.load_crl(d / "crl.pem", ca).next_update_utc
    assert before is not None and after is not None
    assert after - before > dt.timedelta(days=59)


def test_through_the_installed_medfed_entry_point(tmp_path: Path) -> None:
    # The real console script: `pki` is found through the medfed.commands entry point.
    script = Path(sys.executable).parent / "medfed"
    d = tmp_path / "pki"
    for args in (["init", "--dir", d], ["issue", "--dir", d, "--site", "h1"]):
        done = subprocess.run(
            [str(script), "pki", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    assert pki.site_id_from_certificate(pki.load_certificate(d / "sites/h1.crt")) == "h1"
    refused = subprocess.run(
        [str(script), "pki", "issue", "--dir", str(d), "--site", "h1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("medfed: error:") and "refusing to overwrite" in refused.stderr
