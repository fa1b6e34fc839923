"""What starts a loop in other processes or on other machines; a loop never imports these. What they start is a
job of `grpo.training.jobs` (one typed job per loop, built once by the stage task, and `run(job, callbacks)`), the
same in the task's own process and in every launched one.

| module | what it starts |
|---|---|
| `launch` | the stage task's side: the job file (`grpo.training.jobs.Launched`), `accelerate launch` of `worker` (one machine or the machines of a job), its events followed and handed to callbacks |
| `worker` | what each launched process runs: the job file checked, `grpo.training.jobs.run`, its reports written as events |
| `join` | what a job's other machines run (`python -m grpo.training.launchers.join`): wait for machine 0's announcement, start their share |
| `ray_train` | the same job as Ray Train workers on a Ray cluster, restarted from the last checkpoint when a node is lost |

May import everything in `grpo/` (the loops included, inside functions so a launcher loads only the loop it runs);
nothing in `grpo/` imports a launcher. Must not depend on Prefect or MLflow: the stage tasks (`tasks/`) log what
the launchers report.
"""
