"""Real PKI material for the signed-ledger tests: a federation CA, two sites, a site
certificate replaced mid-history, and a foreign CA issuing a look-alike certificate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from common.privacy.signed import LedgerSigner
from common.protocol import pki


@dataclass(frozen=True)
class Pki:
    root: Path
    ca: Path
    signer_a: LedgerSigner  # hospital-a's first certificate
    signer_a_renewed: LedgerSigner  # hospital-a's replacement certificate (new key)
    signer_b: LedgerSigner
    impostor_a: LedgerSigner  # a certificate for "hospital-a" from ANOTHER CA


def _signer(root: Path, site: str) -> LedgerSigner:
    cert, key = pki.site_paths(root, site)
    return LedgerSigner.from_files(cert, key)


@pytest.fixture(scope="session")
def pki_material(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root)
    pki.issue_site(root, "hospital-a")
    first = _signer(root, "hospital-a")
    pki.issue_site(root, "hospital-a", force=True)
    renewed = _signer(root, "hospital-a")
    pki.issue_site(root, "hospital-b", algorithm="ed25519")
    foreign = tmp_path_factory.mktemp("foreign-pki")
    pki.init_ca(foreign)
    pki.issue_site(foreign, "hospital-a")
    return Pki(
        root=root,
        ca=root / pki.CA_CERT,
        signer_a=first,
        signer_a_renewed=renewed,
        signer_b=_signer(root, "hospital-b"),
        impostor_a=_signer(foreign, "hospital-a"),
    )
