"""Backoff decoding, pure algorithm: no Ray, no network (DESIGN.md; README "Layout").

Subpackages by role, dependencies pointing down this list only:
- `types`, `sampling`: the records every stage passes, and on-device counter-based draws;
- `models`: loading checkpoints / GGUF / the embedded default pair, CPU kernels, prompts;
- `runners`: running one model over sessions: per-session caches or static KV slots + CUDA graphs;
- `routing`: decision functions (routers), the classifier head, the target-rate controller;
- `engine`: the step loop (small step, catch-up, verification, isolation of failures);
- `parallel`: a model split over tensor-parallel ranks, driven as one runner (rank 0 here);
- `learning`: router training data, training and calibration;
- `evaluation`: teacher-forced and generation evaluation of routers, report and plots;
- `cli`: the `backoff` command.
"""
