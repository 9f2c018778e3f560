"""Router training: corpora, per-position data from the pair, training and calibration of the head."""
