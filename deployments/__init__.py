"""Ray Serve deployment of backoff decoding (DESIGN.md §4): the only package importing Ray.

Ingress (HTTP + gRPC) -> SmallModel (M_S + decision function + step loop)
-> LargeModel (M_L; batched catch-up; one session per request; affinity by session).
The Ray-free parts live in `deployments.serving` (config, edge, formats, step-loop driver,
batcher, remote M_L endpoint) and are importable without Ray.
"""
