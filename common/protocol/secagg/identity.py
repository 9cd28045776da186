"""How the SecAgg+ state machines learn who signed what: the signer's certificate key.

Both sides verify signatures (a site its neighbours' keys and the survivor-list
confirmations, the coordinator every advertisement and confirmation) with the key of
the signer's certificate. Checking a certificate needs the PKI (chain, CRL, the site id
it names), which is I/O and a clock: the networked layer does it and hands the state
machines an `IdentityVerifier`, so they stay pure.
"""

from __future__ import annotations

from collections.abc import Callable

from common.crypto.signing import VerifyingKey

IdentityVerifier = Callable[[str, bytes], VerifyingKey]
"""(site_id, certificate_der) -> the key that must have signed for that site.

Raises CryptoError or CertificateRejected (a site turns these into the abort reason of
the check at hand), or ProtocolAbort with its own reason (NOT_A_SITE, UNKNOWN_MEMBER,
REVOKED_PEER), which propagates unchanged. The networked layer checks the chain to the
federation CA and that the certificate names `site_id`. A site calls it only for the
sites whose signatures it verifies (`common.protocol.secagg.client_signatures`)."""

