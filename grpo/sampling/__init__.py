"""Sampling: generation behind one interface, and what is built on it (the LLM judge, the engine thread `r1 serve`
serves; its HTTP app is `flows/cli/serve.py`, so no web framework is imported here).

| module | what it holds |
|---|---|
| `engines` | the one place that picks a stage's engine (`build_engine`) from its `generation` section |
| `rollout` | what every engine returns (`Rollout`, token ids where it has them, text always) and offers (`Engine`) |
| `draws` | each row's random stream, counter-based: a row's tokens depend on its prompt and its stream alone, not its slot or the budget |
| `local` | the local engine (`TransformersBackend`), a package: the static sampler, its slots, decode step, paged KV cache and lean decoder behind the surface its `__init__` exports |
| `http_backend` | the http engine (`HTTPGenerationBackend`): `/v1/completions` servers, spread over, failed over |
| `judge` | the LLM judge: a local model or any OpenAI-compatible endpoint |
| `openai_client` | the HTTP client both share: one JSON request, retries and backoff, errors that say what failed |
| `batcher` | the engine thread behind `r1 serve` (`RequestBatcher`): every client's rows decoded together, continuously batched |
| `openai_requests` | what `r1 serve` accepts: OpenAI chat and completions bodies checked field by field (`Request`) |

To add an engine: a class with `generate(prompts, n, sampling) -> Rollout` and `sync_weights()` (see `rollout`), and
its name in `GenerationConfig.backend` and `engines.build_engine`. Must not depend on Prefect or MLflow.
"""
