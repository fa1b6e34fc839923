"""Kernels: speed and memory tricks that give the model's own numbers (the model-level ones are switched on
for a block and restored; `logprobs` is a function `grpo.training.logprobs` calls; `gemm` measures a plan once and
runs the model's linears by it).

| module | what it holds |
|---|---|
| `attention` | grouped-query attention without copying K/V heads (CPU training) |
| `mlp` | a SwiGLU that keeps less for the backward |
| `logprobs` | completion log-probs and entropy from the hidden states, chunked: no [N, C, V] logits kept |
| `gemm` | fp32 linears on a CPU through the faster of MKL and oneDNN for each GEMM, timed on the loop's shapes (`fp32_gemm: auto`) |

Each is tested against the plain path (values and gradients). Must not depend on Prefect or MLflow.
"""
