"""Hooks: connections to the systems Slipway's operators drive."""
