"""The MLflow UI's pages for runs, and the commands that serve it, as `r1` prints them.

For a local store (SQLite) the UI is served by `mlflow ui` on this machine; with a tracking server, by the server.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.tracking import client, tracking_uri

# where `mlflow ui --port 5000` (what `r1 where` says to run for a local store) serves the UI
LOCAL_UI_PORT = 5000


def ui_command(uri: str | None = None) -> str:
    """The command that serves the MLflow UI for a local store (the tracking URI by default), as it can be pasted:
    the `mlflow` of this environment by its path where it is not the one on PATH (a virtualenv never activated)."""
    return f"{tool_command('mlflow')} ui --backend-store-uri {uri or tracking_uri()} --port {LOCAL_UI_PORT}"


def tool_command(name: str) -> str:
    """How to call the console script `name` of this environment from any shell: its bare name where PATH finds
    that very script, else its path beside this interpreter."""
    import sys

    here = Path(sys.executable).parent / name
    if not here.exists():
        return name
    found = shutil.which(name)
    return name if found and Path(found).resolve() == here.resolve() else str(here)


def ui_base(uri: str | None = None) -> str:
    """The MLflow UI's address: a tracking server's own, else the one `ui_command` serves on this machine."""
    uri = uri or tracking_uri()
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else f"http://127.0.0.1:{LOCAL_UI_PORT}"


def ui_links(runs: dict[str, str], uri: str | None = None) -> dict[str, str]:
    """MLflow UI pages for `runs` ({run id: its experiment id}): under "runs" the first run's experiment's runs
    list, under each run id the run's page, and under "compare", for two runs or more, their comparison.

    These are the routes of MLflow 3.17's UI (hash routes, `#/...`). Its GenAI / Model training switch decides what
    an experiment opens on: the `workflowType` parameter sets it, else the browser's last choice, else GenAI, whose
    overview shows traces (none here), whatever the experiment's kind tag says. So each link names its page, and
    carries `workflowType=machine_learning` so the UI around it is the model-training one (Runs, Models, registry).
    """
    from urllib.parse import quote

    base, view = ui_base(uri), "workflowType=machine_learning"
    ids, experiments = list(runs), list(dict.fromkeys(runs.values()))
    links = {"runs": f"{base}/#/experiments/{experiments[0]}/runs?{view}"}
    links.update({run_id: f"{base}/#/experiments/{exp}/runs/{run_id}?{view}" for run_id, exp in runs.items()})
    if len(ids) > 1:  # the page takes JSON lists, as the UI's own "Compare" button writes them
        as_json = lambda items: quote("[" + ",".join(f'"{i}"' for i in items) + "]", safe="")  # noqa: E731
        links["compare"] = f"{base}/#/compare-runs?runs={as_json(ids)}&experiments={as_json(experiments)}&{view}"
    return links


def ui_text(runs: dict[str, str]) -> str:
    """What `r1` prints to open `runs` ({label: run id}) in the MLflow UI: the runs list, each run, their comparison."""
    c = client()
    experiments = {run_id: c.get_run(run_id).info.experiment_id for run_id in runs.values()}
    links = ui_links(experiments)
    uri = tracking_uri()
    where = "" if uri.startswith(("http://", "https://")) else f" (serve it first: {ui_command(uri)})"
    rows = {f"runs of {c.get_experiment(next(iter(experiments.values()))).name}": links["runs"]}
    rows.update({label: links[run_id] for label, run_id in runs.items()})
    if "compare" in links:
        rows[f"{' and '.join(runs)} compared"] = links["compare"]
    width = max(len(label) for label in rows)
    return "\n".join([f"MLflow UI{where}:"] + [f"  {label:<{width}} : {url}" for label, url in rows.items()])
