"""Sampling: generation behind one interface, and what is built on it (the LLM judge, the chat server).

| module | what it holds |
|---|---|
| `backend` | `GenerationBackend` (`generate(prompts, n, sampling) -> Rollout`) and its transformers implementation |
| `static_sampler` | the sampler for Llama-family decoders: static KV cache, in-step sampling, CUDA graphs on a GPU |
| `cpu_decoder` | a lean decode step for plain Qwen2/Llama models (its fused, packed linears serve the static sampler) |
| `http_backend` | `HTTPGenerationBackend`: samples from `/v1/completions` servers, spread over them, failed over |
| `judge` | the LLM judge: a local model or any OpenAI-compatible endpoint |
| `openai_client` | the HTTP client both share: one JSON request, retries and backoff, errors that say what failed |
| `serve` | `r1 serve`: a checkpoint as an OpenAI-compatible endpoint (chat and text completions) |

To add a generation backend: a class with `generate(prompts, n, sampling) -> Rollout` (see `backend`), chosen where
the stage builds its backend. Must not depend on Prefect or MLflow.
"""
