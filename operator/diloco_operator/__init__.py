"""Kubernetes operator for DiLoCoJob resources."""

__version__ = "0.1.0"
