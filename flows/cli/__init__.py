"""The `r1` command line and what only it uses: the local stack (`r1 up`), the temporary Prefect API of one `r1`
process, pre-flight checks, `r1 plan`, `r1 compare` and `r1 serve`'s
HTTP app (`serve`, FastAPI on uvicorn, over `grpo.sampling.batcher`). The flows themselves live one folder up."""
