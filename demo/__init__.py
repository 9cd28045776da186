"""`medfed demo`: the whole product on one machine, in a few minutes.

A PKI, one coordinator and several site agents as separate processes over mutual TLS
on 127.0.0.1, each site with its own non-IID data, its own privacy ledger and an epsilon
budget; several rounds of DP-SGD with SecAgg+, one site killed mid-round where the
federation survives it; then the privacy/utility table. The demo drives both services,
so it lives beside them (`coordinator/` and `site_agent/` never import it):

* `demo.run`: the one `Demo`, from setup to report, with a task strategy (`demo.tasks`):
  `demo.tabular` (the sepsis cohort or ``--data DIR``) or `demo.imaging`
  (``--task imaging``);
* `demo.enrolment`: the PKI, the study's members and their approvals, the split keys;
* `demo.processes`: the coordinator and site agents as processes, and their failures;
* `demo.rounds`: the rounds followed, the site killed mid-round and restarted;
* `demo.options`, `demo.cli`: the options and the ``medfed demo`` command;
* `demo.terms`: the SecAgg+ terms and whether a dropout is injected;
* `demo.report`: report.json, the plots and the table; `demo.hospital`: hospital-level DP;
* `demo.study`: the study drafted from ``--data``; `demo.audit`: the membership audit;
* `demo.watch`: what the demo says while it waits, and a process's last error.
"""
