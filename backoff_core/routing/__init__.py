"""Decision functions (routers), the classifier head over M_S hidden states, the target-rate controller."""
