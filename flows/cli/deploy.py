"""`r1 deploy`: every stage's deployment, made from its declaration (flows/stages.py) and a recipe.

A stage whose recipe section names a pool (`resources.pool`) gets the deployment `<stage>/<pool>` on that pool:
the deployment the pipeline runs when it places the stage there, carrying the recipe's section as its default
`config` and its resources as job variables, so a person who runs the stage alone from the UI gets the same. With
`--pool`, the stages that name none are deployed on that pool too (`r1 up` puts all of them on its process pool).
The pipeline's own deployments are declarations in deployments/prefect.yaml.
"""

from __future__ import annotations

from flows.stages import declared
from grpo.configs.recipe import Recipe


def stage_pools(recipe: Recipe, pool: str | None = None) -> dict[str, str]:
    """Stage name -> the pool it is deployed on: its own `resources.pool`, else `pool` (stages with neither: none)."""
    found = {name: config.resources.pool or pool for name, config in recipe.stage_configs().items()}
    return {name: where for name, where in found.items() if where}


def deploy_stages(recipe: Recipe, pool: str | None = None, keep_existing: bool = False) -> list[str]:
    """Create or update each stage's deployment on its pool; returns their names (`<stage>/<pool>`). With
    `keep_existing` (`r1 up`), a deployment already on the server is left as it is: what `r1 deploy --set` or the UI
    made of it survives a `r1 down` and `r1 up`."""
    from prefect.deployments.runner import EntrypointType

    made = []
    for name, where in stage_pools(recipe, pool).items():
        stage, config = declared()[name], getattr(recipe, name)
        if keep_existing and _exists(f"{stage.flow.name}/{where}"):
            continue
        summary = (stage.flow.description or name).strip().splitlines()[0]
        deployment = stage.flow.to_deployment(
            name=where, work_pool_name=where, job_variables=config.resources.as_job_variables(),
            parameters={"config": config.model_dump(mode="json")}, description=f"{summary} (recipe {recipe.name})",
            tags=["r1", "stage"], enforce_parameter_schema=True,
            entrypoint_type=EntrypointType.MODULE_PATH)  # the installed package, wherever the worker runs
        deployment.apply()
        made.append(f"{name}/{where}")
    return made


def _exists(deployment: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return False
    return True
