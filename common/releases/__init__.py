"""The release seam and every DP release a site makes: the egress manifest, the
study's statistics, the evaluation histogram, analytics queries, and what is
read from them (the bundle, intervals, thresholds). Imports core, crypto,
protocol, privacy, study and models (docs/architecture.md, "The floors of common/")."""
