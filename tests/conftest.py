"""Test setup: float32 everywhere, repo root importable (`sparrow_jax`, `kernels`)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
