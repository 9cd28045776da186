"""Federated DP analytics: questions asked of the pooled cohort before any model.

A query file (`query`) names a cohort filter and statistics over a study's declared
data, each of a kind that is one module of `statistics` (the protocol: `statistic`);
every site computes one integer vector of bounded contributions (`vector`), adds
its share of distributed discrete Gaussian noise and masks it under SecAgg+; the
coordinator reads the noisy sum into answers with their uncertainty (`answer`).
`check` runs a query offline on a site's own file. Pure: no grpc, clock or OS
randomness here (the noise comes from the release seam, `common.releases.seam`).
"""
