"""Kernels: speed and memory tricks that give the model's own numbers, each switched on for a block and restored.

| module | what it holds |
|---|---|
| `attention` | grouped-query attention without copying K/V heads (CPU training) |
| `mlp` | a SwiGLU that keeps less for the backward |

Each is tested against the plain path (values and gradients). Must not depend on Prefect or MLflow.
"""
