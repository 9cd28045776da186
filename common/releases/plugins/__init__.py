"""The DP releases, one module each, named as the release it registers: every module of
this folder is imported by `common.releases.seam.load_releases` (found by file name, as
the model registry finds networks), and registers its release (`register_release`) when
imported. A new release is one file here (docs/privacy.md, "Adding a DP release")."""
