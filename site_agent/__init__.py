"""The site agent: client loop, Opacus trainer, data, models, budget guard, metrics."""
