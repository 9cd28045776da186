"""``medfed pki``: create the federation CA, sign hospitals' requests, revoke and list.

Real federation: the hospital runs ``pki request`` (its key never leaves it) and sends
the CSR; the operator runs ``pki sign`` and returns the certificate. ``pki issue
--site`` generates the key at the operator and is for single-host demos only.

Registered through the ``medfed.commands`` entry point (``pki``). Every failure is a
`MedfedError`, which `common.commands.cli` prints as one line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from common.commands.cli import main_with
from common.core.errors import ConfigError
from common.protocol import pki


def register(subparsers: Any) -> None:
    """Add ``medfed pki {init,issue,request,sign,revoke,crl,list}`` to the sub-parsers."""
    parser = subparsers.add_parser(
        "pki",
        help="federation CA and certificates (mutual TLS identities)",
        description="Create the federation CA, issue the coordinator and monitor "
        "certificates, sign hospitals' certificate requests, revoke. A hospital makes "
        "its own key with `pki request` and sends only the CSR; the operator signs it "
        "with `pki sign` and returns ca.crt and sites/SITE_ID.crt. Private keys are "
        "written unencrypted with mode 0600.",
    )
    actions = parser.add_subparsers(dest="pki_command", metavar="ACTION", required=True)

    init = actions.add_parser("init", help="create the CA (ca.crt, ca.key, empty crl.pem)")
    init.add_argument("--dir", required=True, type=Path, help="PKI directory (created 0700)")
    init.add_argument("--algorithm", choices=pki.ALGORITHMS, default="ecdsa-p256")
    init.add_argument("--validity-days", type=int, default=pki.DEFAULT_CA_VALIDITY_DAYS)
    init.add_argument("--name", default="medfed federation CA", help="CA subject CN")
    init.set_defaults(func=_init)

    issue = actions.add_parser(
        "issue",
        help="issue the coordinator or a monitor certificate (or a demo site's)",
        description="Generate a key pair and certificate at the operator. For a real "
        "hospital use `pki request` there and `pki sign` here instead: --site is for "
        "single-host demos only (the operator would hold the hospital's private key).",
    )
    issue.add_argument("--dir", required=True, type=Path)
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--coordinator",
        metavar="HOST[,HOST...]",
        help="DNS names / IP addresses the sites dial (add 127.0.0.1,localhost only for tests)",
    )
    who.add_argument(
        "--monitor",
        metavar="NAME",
        help="monitor (health probe) certificate: may call Health and status RPCs only",
    )
    who.add_argument(
        "--site",
        metavar="SITE_ID",
        help="DEMO ONLY: generates the hospital's key here; real sites use request/sign",
    )
    issue.add_argument("--validity-days", type=int, default=pki.DEFAULT_LEAF_VALIDITY_DAYS)
    issue.add_argument(
        "--algorithm",
        # Ed25519 leaves are refused: gRPC's TLS stack cannot sign handshakes with them
        # (see common/protocol/tls.py). An Ed25519 CA works.
        choices=["ecdsa-p256"],
        default="ecdsa-p256",
        help="leaf key type (gRPC's TLS supports EC P-256 leaves only; the CA may be Ed25519)",
    )
    issue.add_argument(
        "--force", action="store_true", help="move existing files aside into replaced/ first"
    )
    issue.set_defaults(func=_issue)

    request = actions.add_parser(
        "request",
        help="(at the hospital) make this site's key and a certificate request",
        description="Writes OUT/SITE_ID.key (mode 0600: it never leaves this machine) "
        "and OUT/SITE_ID.csr. Send only the .csr to the federation operator, who runs "
        "`medfed pki sign` and returns SITE_ID.crt and ca.crt.",
    )
    request.add_argument("--out", required=True, type=Path, help="folder (created 0700)")
    requester = request.add_mutually_exclusive_group(required=True)
    requester.add_argument("--site", metavar="SITE_ID", help="this hospital's site id")
    requester.add_argument("--monitor", metavar="NAME", help="a monitor's name")
    request.set_defaults(func=_request)

    sign = actions.add_parser(
        "sign",
        help="(at the operator) sign a hospital's certificate request",
        description="Checks the request's signature and the site id, and writes "
        "PKI/sites/SITE_ID.crt (or monitors/NAME.crt). Refuses an id that already has "
        "a valid certificate unless --replace, which also revokes the old one.",
    )
    sign.add_argument("--dir", required=True, type=Path)
    sign.add_argument("--csr", required=True, type=Path, help="the .csr file received")
    sign.add_argument(
        "--replace",
        action="store_true",
        help="revoke the id's current certificate(s) and sign this request (lost key, "
        "compromise, rotation)",
    )
    sign.add_argument("--validity-days", type=int, default=pki.DEFAULT_LEAF_VALIDITY_DAYS)
    sign.set_defaults(func=_sign)

    revoke = actions.add_parser("revoke", help="revoke every certificate of a site or monitor")
    revoke.add_argument("--dir", required=True, type=Path)
    revoked = revoke.add_mutually_exclusive_group(required=True)
    revoked.add_argument("--site", metavar="SITE_ID")
    revoked.add_argument("--monitor", metavar="NAME")
    revoke.add_argument(
        "--crl-validity-days",
        type=int,
        default=pki.DEFAULT_CRL_VALIDITY_DAYS,
        help="nextUpdate of the new CRL; verifiers refuse everyone after it",
    )
    revoke.set_defaults(func=_revoke)

    crl = actions.add_parser("crl", help="re-sign crl.pem with a new nextUpdate (run from cron)")
    crl.add_argument("--dir", required=True, type=Path)
    crl.add_argument("--crl-validity-days", type=int, default=pki.DEFAULT_CRL_VALIDITY_DAYS)
    crl.set_defaults(func=_crl)

    listing = actions.add_parser(
        "list", help="list certificates, also those moved into replaced/, with expiry and "
        "revocation")
    listing.add_argument("--dir", required=True, type=Path)
    listing.set_defaults(func=_list)

    members = actions.add_parser(
        "members",
        help="print [policy.members] (site id = SHA-256 of its certificate public key) for "
        "sites that pin the consortium's membership, or with --study the [[members]] a "
        "study lists",
    )
    members.add_argument("--dir", required=True, type=Path)
    members.add_argument(
        "--study", action="store_true",
        help="print [[members]] tables to append to a study file (what `study init "
        "--member-from` writes)")
    members.set_defaults(func=_members)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _warn_if_expiring(path: Path, not_after: dt.datetime, now: dt.datetime) -> None:
    days = (not_after - now).total_seconds() / 86400.0
    if days < 0:
        print(f"warning: {path} EXPIRED on {not_after.date().isoformat()}", file=sys.stderr)
    elif days <= pki.EXPIRY_WARNING_DAYS:
        print(
            f"warning: {path} expires in {days:.0f} days ({not_after.date().isoformat()})",
            file=sys.stderr,
        )


def _init(args: argparse.Namespace) -> int:
    cert = pki.init_ca(
        args.dir, algorithm=args.algorithm, validity_days=args.validity_days, name=args.name
    )
    print(f"created CA {cert.subject.rfc4514_string()} in {args.dir}")
    print(f"  {args.dir / pki.CA_KEY} is the CA private key: keep it offline / 0600")
    return 0


def _issue(args: argparse.Namespace) -> int:
    now = _now()
    if args.coordinator is not None:
        hosts = [h for h in args.coordinator.split(",") if h.strip()]
        if not hosts:
            raise ConfigError("--coordinator", "give at least one host name or IP address")
        issued = pki.issue_coordinator(
            args.dir,
            hosts,
            validity_days=args.validity_days,
            algorithm=args.algorithm,
            force=args.force,
            now=now,
        )
    elif args.monitor is not None:
        issued = pki.issue_monitor(
            args.dir,
            args.monitor,
            validity_days=args.validity_days,
            algorithm=args.algorithm,
            force=args.force,
            now=now,
        )
    else:
        issued = pki.issue_site(
            args.dir,
            args.site,
            validity_days=args.validity_days,
            algorithm=args.algorithm,
            force=args.force,
            now=now,
        )
    cert = issued.certificate
    print(f"issued {cert.subject.rfc4514_string()} serial {cert.serial_number:x}")
    print(f"  certificate {issued.cert_path}")
    print(f"  key         {issued.key_path} (mode 0600)")
    print(f"  valid until {cert.not_valid_after_utc.isoformat()}")
    _warn_if_expiring(issued.cert_path, cert.not_valid_after_utc, now)
    if args.site is not None:
        print(
            "  note        SINGLE-HOST DEMO ONLY: this machine generated the hospital's "
            "private key; a real hospital runs `medfed pki request` and you `medfed pki sign`"
        )
    ca = pki.load_ca(args.dir)
    _warn_if_expiring(args.dir / pki.CA_CERT, ca.not_valid_after_utc, now)
    return 0


def _request(args: argparse.Namespace) -> int:
    role, name = (pki.Role.SITE, args.site) if args.site else (pki.Role.MONITOR, args.monitor)
    files = pki.request_certificate(args.out, name, role=role)
    csr, _ = pki.load_request(files.csr_path)
    print(f"wrote {files.key_path} (mode 0600): the private key, it never leaves this machine")
    print(f"wrote {files.csr_path}: send this request to the federation operator")
    print(f"  public key SHA-256 {pki.public_key_fingerprint(csr)}: read it to the operator "
          "(by phone, not with the request); `medfed pki sign` and `pki members` show the "
          "same value for the certificate signed from it")
    return 0


def _sign(args: argparse.Namespace) -> int:
    now = _now()
    signed = pki.sign_request(
        args.dir, args.csr, replace=args.replace, validity_days=args.validity_days, now=now
    )
    cert = signed.certificate
    identity = signed.identity
    print(
        f"signed {identity.role.value} {identity.name} serial {cert.serial_number:x} "
        f"(public key SHA-256 {pki.public_key_fingerprint(cert)})"
    )
    print(f"  certificate {signed.cert_path}: return it with {args.dir / pki.CA_CERT}")
    print(f"  valid until {cert.not_valid_after_utc.isoformat()}")
    if signed.revoked_serials:
        listed = ", ".join(f"{s:x}" for s in signed.revoked_serials)
        print(f"  revoked the previous certificate(s) {listed}; {args.dir / pki.CRL_FILE} updated")
    _warn_if_expiring(signed.cert_path, cert.not_valid_after_utc, now)
    return 0


def _revoke(args: argparse.Namespace) -> int:
    role, name = (pki.Role.SITE, args.site) if args.site else (pki.Role.MONITOR, args.monitor)
    serials = pki.revoke(
        args.dir, role, name, crl_validity_days=args.crl_validity_days, now=_now()
    )
    listed = ", ".join(f"{s:x}" for s in serials)
    print(
        f"revoked {role.value} {name} (serials {listed}); {args.dir / pki.CRL_FILE} updated"
    )
    return 0


def _crl(args: argparse.Namespace) -> int:
    crl = pki.refresh_crl(args.dir, crl_validity_days=args.crl_validity_days, now=_now())
    next_update = crl.next_update_utc.isoformat() if crl.next_update_utc else "never"
    print(f"re-signed {args.dir / pki.CRL_FILE}; next update {next_update}")
    return 0


def _list(args: argparse.Namespace) -> int:
    now = _now()
    rows = pki.list_certificates(args.dir)
    print(f"{'subject':<40} {'serial':<40} {'not_after':<26} {'file':<9} revoked")
    for row in rows:
        print(
            f"{row.subject:<40} {row.serial:<40x} {row.not_after.isoformat():<26} "
            f"{'replaced' if row.replaced else 'current':<9} {'yes' if row.revoked else 'no'}"
        )
        if not row.revoked and not row.replaced:
            _warn_if_expiring(row.path, row.not_after, now)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m common.commands.pki ...``: the same commands without the other plug-ins.

    Useful on an operator machine where only the PKI is needed, and in tests; errors are
    printed the way `common.commands.cli.main` prints them (one line, exit code 2).
    """
    return main_with([register], argv)


def _members(args: argparse.Namespace) -> int:
    members = pki.site_members(args.dir, now=_now())
    if not members:
        raise ConfigError("--dir", f"no valid, unrevoked site certificate in {args.dir}")
    if args.study:
        print("# The study's hospitals, each with its public-key SHA-256: compare each with")
        print("# the fingerprint its officer read out (`medfed pki request`).")
        for site_id, fingerprint in members.items():
            print(f'[[members]]\nname = "{site_id}"\nfingerprint = "{fingerprint}"')
        return 0
    print("# Paste into every site's configuration (site.toml). Compare each line with the")
    print("# fingerprint the hospital read out when its CSR was signed (`medfed pki sign`).")
    print("# The study pins the same values for every site ([[members]]: `medfed study init")
    print("# --member-from pki/sites/SITE.crt`); this table is a site's own extra pin.")
    print("[policy.members]")
    for site_id, fingerprint in members.items():
        print(f'"{site_id}" = "{fingerprint}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())

