"""The `r1` command line and what only it uses: the local stack (`r1 up`), the temporary Prefect API of one `r1`
process, pre-flight checks, `r1 plan` and `r1 compare`. The flows themselves live one folder up."""
