"""Networks for tabular data: one module per network, named as the study names it."""
