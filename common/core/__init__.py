"""The ground floor: errors, parsing, files, codecs, logs, processes, the state
database and the services' settings. Imports nothing else of medfed
(docs/architecture.md, "The floors of common/")."""
