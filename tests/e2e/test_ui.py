"""The UIs in a real (headless) browser: start a stage's deployment from Prefect's *Custom run* form and watch it
run; open the MLflow pages `r1` prints and find the runs on them.

A Prefect server on a free port with every deployment and a process worker (MLflow on SQLite in a temp folder);
Chromium opens the cold_start_sft deployment's custom-run form, changes a few fields of the stage's config form
(so the run is small), submits, and follows the flow run's page until it says Completed. An `mlflow server` on
127.0.0.1 holds two pipeline runs made through `runtime.tracking`; Chromium opens each link `r1 compare` prints.

Needs Debian's `chromium` and `chromium-driver` and `selenium` (the dev extra); `make test` installs them where it
may (root with apt-get, as in CI). Without them the tests are skipped, saying how to get them, except in CI (`CI`
set), where they fail: there a missing browser is a broken install, not a reason to test less.
"""

from __future__ import annotations

import os
import re

import pytest
from mlflow import MlflowClient

from browser import browser_missing, click, console, start_browser, type_into, wait_for
from flows.cli import stack

@pytest.fixture(scope="session", autouse=True)
def needs_chromium():
    """Skip (fail in CI) before any server starts: session scope puts it ahead of the session-wide Prefect server."""
    if reason := browser_missing():
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: `make test` installs them as root; see its output)", pytrace=False)
        pytest.skip(reason)


# form field label -> value typed into it: a run of a few seconds instead of the recipe's 500 steps
CHANGES = {"Max Steps": "2", "Num Train": "64", "Num Heldout": "0", "Log Every": "1", "Checkpoint Every": "0"}


@pytest.fixture(scope="module")
def team_stack(deployed_server, tmp_path_factory):
    """The session's Prefect server (every deployment) and a process worker of this module's own."""
    root, api = tmp_path_factory.mktemp("ui"), deployed_server["api"]
    tracking = f"sqlite:///{root / 'mlflow.db'}"
    worker = stack.start_worker(api, tracking, root / "logs", PREFECT_WORKER_QUERY_SECONDS="2", OMP_NUM_THREADS="1")
    try:
        yield {"api": api, "ui": api.removesuffix("/api"), "tracking": tracking, "worker": worker}
    finally:
        stack.stop_process(worker)


@pytest.fixture
def browser(tmp_path):
    driver = start_browser(tmp_path / "chromium")
    yield driver
    driver.quit()


def test_a_custom_run_from_the_ui_completes(team_stack, browser):
    import json
    import urllib.request

    from selenium.webdriver.common.by import By

    request = urllib.request.Request(team_stack["api"] + "/deployments/filter", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        [deployment] = [d for d in json.load(reply)  # the stage's deployment `r1 deploy` made from its declaration
                        if d["name"] == "r1-process" and d["entrypoint"].startswith("flows.cold_start_sft")]

    def fill_and_submit() -> None:
        browser.get(f"{team_stack['ui']}/deployments/deployment/{deployment['id']}")
        wait_for("the deployment page's Run button", lambda: click(browser, "//button[normalize-space()='Run']"), 60,
                 browser)
        wait_for("the Custom run menu item", lambda: click(browser, "//*[normalize-space()='Custom run']"), 30,
                 browser)
        wait_for("the custom-run form", lambda: "/run" in browser.current_url and browser.find_elements(
            By.XPATH, "//span[starts-with(normalize-space(), 'Max Steps')]"), 60, browser)
        for label, value in CHANGES.items():
            type_into(browser, label, value)
        click(browser, "//button[@type='submit' and normalize-space()='Submit']")

    def created() -> bool:
        """The UI made the run: its toast's View run button opens the run's page; a run of the deployment on the
        server (the toast gone before it was seen, or the UI still on its way back) is opened by its address."""
        if click(browser, "//*[contains(@class, 'toast-flow-run-create__button')]"):
            return True
        if made := [r for r in _runs_of(team_stack["api"], deployment["id"]) if r["id"] not in before]:
            browser.get(f"{team_stack['ui']}/runs/flow-run/{made[0]['id']}")
            return True
        return False

    # the UI goes back to the deployment and says "Flow run created" in a toast with a View run button (the server
    # validates the parameters and creates the run first: over a minute at times on 2 cores beside two test files).
    # A submit can be lost, in CI and once in ~5 tries here (the form stayed, with no run on the server, for minutes
    # and through clicks again): then the form is opened and filled again, a new page, up to three times
    before = {r["id"] for r in _runs_of(team_stack["api"], deployment["id"])}  # other files' runs of it, if any
    for attempt in range(3):
        fill_and_submit()
        try:
            wait_for("the flow run the form made", created, 90, browser)
            break
        except AssertionError as e:
            if attempt == 2:
                raise AssertionError(f"{e}\nthe browser's console: {console(browser)}") from None
            print(f"the custom-run form made no run in 90 s (attempt {attempt + 1}); {e}")
    flow_run_id = wait_for("the flow run's page", lambda: "/runs/flow-run/" in browser.current_url and
                           browser.current_url.rsplit("/flow-run/", 1)[1].split("?")[0], 60, browser)
    state = wait_for("the flow run to end", lambda: _final_state(team_stack["api"], flow_run_id), 480)
    assert state == "COMPLETED", open(team_stack["worker"].log).read()[-3000:]
    # and the page the UI left us on says so (it polls the API while the run is open)
    wait_for("the flow run page to say Completed", lambda: browser.find_elements(
        By.XPATH, "//*[normalize-space()='Completed']"), 60, browser)

    # the changed fields reached the flow: the stage's MLflow run records them as params
    mlflow = MlflowClient(tracking_uri=team_stack["tracking"])
    [run] = mlflow.search_runs([e.experiment_id for e in mlflow.search_experiments()],
                               f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "2" and run.data.params["data.num_train"] == "64"


def _runs_of(api: str, deployment_id: str) -> list:
    import json
    import urllib.request

    body = json.dumps({"deployments": {"id": {"any_": [deployment_id]}}}).encode()
    request = urllib.request.Request(f"{api}/flow_runs/filter", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.load(reply)


def _final_state(api: str, flow_run_id: str) -> str | None:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as reply:
        state = json.load(reply)["state"]
    return state["type"] if state and state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None


@pytest.fixture(scope="module")
def mlflow_ui(tmp_path_factory):
    """A real `mlflow server` (SQLite in a temp folder, bound to 127.0.0.1 only): its tracking URI is its UI's."""
    root = tmp_path_factory.mktemp("mlflow-ui")
    server, uri = stack.start_mlflow_server(root / "mlflow.db", root / "artifacts", stack.free_port(), root / "logs")
    try:
        yield uri
    finally:
        stack.stop_process(server)


@pytest.fixture
def on_mlflow_ui(mlflow_ui, monkeypatch):
    """`runtime.tracking` pointed at that server for one test, then back at the session's store."""
    import mlflow

    before = os.environ["MLFLOW_TRACKING_URI"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_ui)
    yield mlflow_ui
    mlflow.set_tracking_uri(before)  # tracking.client() set the process-wide one to the server, which now stops


def test_the_printed_mlflow_links_show_the_runs(on_mlflow_ui, browser, capsys):
    from flows.cli.r1 import main
    from runs import make_pipeline

    a = make_pipeline("0.001", 0.25)  # r1_pipeline:tiny, with cold_start_sft and reasoning_grpo child runs
    b = make_pipeline("0.0005", 0.5, stages=("cold_start_sft",), recipe="small")
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    ui = out[out.index("MLflow UI"):].splitlines()
    links = dict(re.fullmatch(r"\s+(.+?)\s+: (\S+)", line).groups() for line in ui[1:])
    assert list(links) == ["runs of r1-pipeline", "A", "B", "A and B compared"], out
    assert all(url.startswith(on_mlflow_ui + "/#/") for url in links.values()), links

    # what each page must show, read from the page the browser rendered (MLflow's UI draws it after loading)
    expected = {"runs of r1-pipeline": ["r1_pipeline:tiny", "r1_pipeline:small"],  # the list: both pipeline runs
                "A": [a, "r1_pipeline:tiny", "cold_start_sft", "reasoning_grpo"],  # the run, with its child runs
                "B": [b, "r1_pipeline:small", "cold_start_sft"],
                "A and B compared": ["Comparing 2 Runs", a, b, "r1_pipeline:tiny", "r1_pipeline:small"]}
    for label, url in links.items():
        browser.get(url)
        body = lambda: browser.find_element("tag name", "body").text  # noqa: E731
        wait_for(f"{label} ({url}) to show {expected[label]}", lambda: all(x in body() for x in expected[label]),
                 60, browser)


def test_a_deep_link_without_a_login_opens_the_login_form_then_the_page(browser, tmp_path):
    """A Prefect server with a login (as `r1 up` starts it): a page's address opened in a browser with no login
    shows the login form (not an empty page with "Oops"), and the login opens the page asked for."""
    import secrets

    from selenium.webdriver.common.by import By

    login = f"r1:{secrets.token_urlsafe(24)}"
    server, api = stack.start_prefect_server(tmp_path / "prefect", stack.free_port(), tmp_path / "logs",
                                             auth={"PREFECT_API_AUTH_STRING": login})
    try:
        browser.get(f"{api.removesuffix('/api')}/deployments")
        field = wait_for("the login form", lambda: "/login" in browser.current_url and browser.find_elements(
            By.XPATH, "//input"), 60, browser)[0]
        assert "redirect=%2Fdeployments" in browser.current_url
        field.send_keys(login)
        wait_for("the Login button", lambda: click(browser, "//button[normalize-space()='Login']"), 30, browser)
        wait_for("the deployments page", lambda: browser.current_url.rstrip("/").endswith("/deployments") and
                 browser.find_elements(By.XPATH, "//*[contains(normalize-space(), 'Create a deployment')]"), 60, browser)
    finally:
        stack.stop_process(server)
