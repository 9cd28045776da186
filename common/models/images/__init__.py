"""Networks for images: one module per network, named as the study names it
(``_``-prefixed modules are shared helpers)."""
