"""The operator's command-line front ends, on top of everything else in common/
(docs/architecture.md, "The floors of common/")."""
