"""The local engine: a model in this process sampling rows, and its public surface.

The stages' engine (`engines.build_engine`), the asynchronous sampler workers and `r1 serve`'s request thread
(`grpo.sampling.batcher`) use only what this package exports below; its modules import one another's public names
only (tests/test_layers.py holds both).

| module | what it holds |
|---|---|
| `backend` | the engine (`TransformersBackend`): the static sampler where the model allows it, else a decode loop; the chat-template helpers every loop renders prompts with (`render_prompts`, `response_text`) |
| `static_sampler` | the sampler for Llama-family decoders (`StaticSampler`): rows streamed through slots of a KV cache, in-step sampling, CUDA graphs on a GPU |
| `slots` | continuous batching (`SlotBatch`): which row each slot holds, the waiting rows, refills, rows handed back as they end |
| `decode_step` | the decode step itself: the slots' state (`SlotState`), each slot at its own position, captured per slot-count bucket |
| `pages` | the paged KV cache (`PagedState`, `PagePool`): pages rows take as they grow, a prompt's shared by its rows |
| `length_rows` | the eager (CPU) step's K/V rows, each row contiguous in a group of rows with as many pages: attention by each row's own length |
| `paged_attention` | one decode step's attention over the pages: a Triton kernel on CUDA, SDPA over gathered pages elsewhere |
| `paged_kernel` | that Triton kernel, loaded only where it runs (CUDA, or Triton's interpreter on a CPU) |
| `cpu_decoder` | a lean decode step for plain Qwen2/Llama models (its fused, packed linears serve the static sampler) |

Must not depend on Prefect or MLflow.
"""

from grpo.sampling.local.backend import TransformersBackend, distinct_rows, render_prompts, response_text, sample_batch
from grpo.sampling.local.slots import Ended, SlotBatch
from grpo.sampling.local.static_sampler import StaticSampler, prompt_bucket, unsupported_reason

__all__ = ["Ended", "SlotBatch", "StaticSampler", "TransformersBackend", "distinct_rows", "prompt_bucket",
           "render_prompts", "response_text", "sample_batch", "unsupported_reason"]
