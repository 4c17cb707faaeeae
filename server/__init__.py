"""The loaderd daemon: config, worker pool, scheduler and gRPC service."""
