"""Slipway trainer: JAX/Equinox/Optax training and evaluation (see docs/trainer.md)."""
