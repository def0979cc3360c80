"""``offpolicy inspect``: measure a model's training–inference mismatch down to the layer."""
