"""The Ray-free parts of the service: config, edge checks, wire formats, the step loop driver,
the catch-up batcher and the remote M_L endpoint. Importable and testable without Ray."""
