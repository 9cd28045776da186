"""The coordinator: gRPC servicer, round engine, server optimizers, metrics."""
