"""Corrections: importance weights, sequence masks, trust regions, vocabulary pruning; composed with ``chain``."""
