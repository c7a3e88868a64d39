"""splitvit: learned hierarchical patch splitting for Vision Transformers (SPLIT)."""

__version__ = "0.1.0"
