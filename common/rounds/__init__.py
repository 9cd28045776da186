"""The round announcement both services share and its wire translation: a round
carries a release, so it stands above them (docs/architecture.md, "The floors of common/")."""
