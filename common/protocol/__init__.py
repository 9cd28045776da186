"""Identity and the secure channels: the federation PKI, mutual TLS, SecAgg+ and
the metrics endpoint. Imports only core and crypto (docs/architecture.md, "The floors
of common/")."""
