"""Benchmarks that print ratios measured side by side in one run: SPLIT against the
full-resolution ViT (:mod:`.forward`), and SPLIT's training step and Ray Train's
overhead (:mod:`.training`)."""
