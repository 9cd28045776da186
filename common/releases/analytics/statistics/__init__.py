"""The kinds of statistic a query may ask, one module each, named as the ``kind`` a query
file writes: every module of this folder is imported by
`common.releases.analytics.statistic.load_statistics` and registers its
`StatisticKind` when imported. A new kind is one file here (docs/analytics.md, "Adding a
kind of statistic")."""
