"""Session-wide fixtures: a temporary R1_HOME, a real MLflow on SQLite in it, and one Prefect test harness.

Environment variables are set at import, before `tasks` or Prefect read them, so nothing a test does touches the
developer's own `.r1/` folder or servers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_HOME = Path(tempfile.mkdtemp(prefix="r1-tests-"))
os.environ["R1_HOME"] = str(_HOME)
os.environ["PREFECT_HOME"] = str(_HOME / "prefect")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_HOME / 'mlflow.db'}"
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW"] = "ignore"
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["HF_DATASETS_CACHE"] = str(_HOME / "hf-datasets")  # what load_dataset builds from local folders
# a new Prefect home (and MLflow store) starts from a migrated copy of its database (flows.cli.prefect_db,
# runtime.store_copies), kept in this cache: the session's first server on a fresh home migrates, the others start
# in a third of the time. One cache for the session: the first process (pytest itself, before it starts its xdist
# workers) names it and the workers inherit the name
os.environ["R1_CACHE"] = os.environ.setdefault("R1_TESTS_CACHE", str(_HOME / "cache"))

# Threads that fit the cores (grpo.cores): `make test` runs two workers (pytest-xdist) on a machine of a few cores,
# and each starts servers, clusters and training processes of its own. Every worker and every process it starts
# gets its share of the cores and OpenMP waits that do not spin, unless the one running the tests set them: spinning
# threads beside each other made steps 10-25x slower on a busy 2-core machine. Set here, before torch loads OpenMP
# (it reads the wait policy once). A test that compares runs to the bit pins its own threads (one_thread_everywhere).
from grpo.cores import share, thread_env  # noqa: E402  (plain Python: imports no torch)

os.environ.update(thread_env(share(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))


def _worker_ports() -> str | None:
    """This worker's own range of ports (grpo.ports, R1_PORTS): the workers' servers, clusters and launches each pick
    a free port and bind it a few seconds later, and two workers picking from the kernel's one ephemeral range at
    once could pick the same one (a Ray node's runtime-env agent once found another cluster's metrics server on its
    port). Below the ephemeral range, above Ray's worker ports (10002-19999), split between the workers."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    width = (ephemeral_low - 20000) // workers
    if width < 500:
        return None
    low = 20000 + index * width
    return f"{low}-{low + width - 1}"


if "R1_PORTS" not in os.environ and (_ports := _worker_ports()):
    os.environ["R1_PORTS"] = _ports

# Each worker imports torch, transformers, Prefect, MLflow and Ray as it collects the tests: without the cyclic
# collector, then one collection and a freeze before the first test (grpo.startup), as every process of the project
# starts; about a sixth of the imports' CPU, and shorter collections during the tests
from grpo import startup  # noqa: E402

startup.defer_collection()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    startup.imports_done()  # a worker's tests are collected (xdist's controller collects none: it runs here too)


# Prefect binds its console log handler to the sys.stderr of the moment it is first imported; import it now,
# under the session's capture, not inside a test whose captured stream is closed when that test ends.
import prefect.main  # noqa: E402,F401  (runs setup_logging)

# tests/helpers is on sys.path (pyproject.toml's pythonpath): what the test files share; no test file imports another
from gsm8k_data import GSM8K_README, gsm8k_rows  # noqa: E402
from tiny_configs import LOGGED_TINY  # noqa: E402


# `make test` runs two files at a time (pytest-xdist, `--dist loadfile`: a file's tests stay in one worker, so its
# module fixtures, a Ray cluster or two-process runs, are made once). A worker takes the next file when it is free,
# in the order collected (`--no-loadscope-reorder`: xdist would otherwise order files by their number of tests):
# these, the files that take a minute or more (measured with --durations), come first, so the two workers end
# together instead of one running the longest file alone at the end.
LONGEST_FIRST = ["test_sweep", "test_signals", "test_tracking_outage", "test_stack", "test_rollouts",
                 "test_placement", "test_disk_full", "test_pipeline_resume", "test_stage_retry", "test_ray_training",
                 "test_rollout_ray", "test_fsdp", "test_moved_home", "test_ray_rejection", "test_deployments", "test_ui",
                 "test_http_generation", "test_distributed", "test_ppo"]


# The files that use the session's deployed Prefect server (`deployed_server`: a `prefect server start` with every
# service, both pools and every deployment; ~45 s of CPU to start, deploy and keep up for a pass) go to one worker
# together, as one unit of work, so the session starts one such server instead of one per worker. The unit is about
# a third of the suite's summed test time and goes out first (test_sweep leads LONGEST_FIRST).
ONE_DEPLOYED_SERVER = "deployed-server"
DEPLOYED_SERVER_FILES = {"test_sweep", "test_placement", "test_pipeline_resume", "test_deployments", "test_ui"}


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order
    strays = sorted({item.path.name for item in items if "deployed_server" in getattr(item, "fixturenames", ())
                     and item.path.stem not in DEPLOYED_SERVER_FILES})
    if strays:  # each would start a second server on whichever worker runs it
        raise pytest.UsageError(f"{', '.join(strays)} use deployed_server: add them to tests/conftest.py's "
                                f"DEPLOYED_SERVER_FILES, so they run on the worker that has it")


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the DEPLOYED_SERVER_FILES as one unit (xdist's own scheduler otherwise)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneDeployedServer(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_DEPLOYED_SERVER if Path(path).stem in DEPLOYED_SERVER_FILES else path

    return OneDeployedServer(config, log)


@pytest.fixture(scope="session")
def r1_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def prefect_harness():
    """One temporary Prefect API for the whole session: the embedded default's local API (flows.cli.local_api), its
    database from the migrated copy in a folder of its own (~5 s to answer where Prefect's own test harness,
    migrating a new database, takes ~10), for this process's Prefect client only: the environment that processes
    started by the tests inherit names no API, as with Prefect's harness."""
    import prefect.context

    from flows.cli.local_api import local_prefect_api

    with local_prefect_api(export=False, home=_HOME / "prefect-harness"):
        # and, as Prefect's harness does, for threads a test starts without copying its context (a flow run in a
        # thread of its own): they see the process-wide settings, which would name no API and start a temporary one
        with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
            yield


@pytest.fixture(scope="session")
def deployed_server(tmp_path_factory):
    """A real `prefect server` on a free port with both work pools and every deployment, for the whole session.

    It takes ~30 s to start and deploy; the modules that need one (deployments, UI) share it and start their own
    workers and MLflow servers, stopping them when the module ends.
    """
    from flows.cli import stack

    root = tmp_path_factory.mktemp("prefect-server")
    prefect, api = stack.start_prefect_server(root / "prefect", stack.free_port(), root / "logs")
    try:
        stack.create_work_pools(api)
        stack.create_zombie_automation(api)
        stack.deploy_all(api)
        yield {"api": api, "root": root}
    finally:
        stack.stop_process(prefect)


@pytest.fixture
def one_thread_everywhere(monkeypatch):
    """One thread in this process and in every process it starts (OMP/MKL_NUM_THREADS), for runs compared to the bit
    across processes: MKL splits a GEMM over the threads it has, and thins them on a busy machine (its dynamic
    threading), so two processes with two threads each can still sum a long reduction in different orders."""
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def answering_checkpoint(tmp_path_factory) -> str:
    """A tiny model trained to answer `<answer>1</answer>` (tests/helpers/answering.py), shared by the rejection
    tests."""
    from answering import train_answering_checkpoint

    return train_answering_checkpoint(tmp_path_factory.mktemp("answering"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> str:
    """48 prompts in a JSON-lines file, a third of them answered 2 and the rest 1 (the answering checkpoint's answer):
    what the rejection-sampling stage reads in the tests that run it (runs.stage_config)."""
    import pandas as pd

    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = pd.DataFrame({"prompt": [f"Problem {i}: what is it?" for i in range(48)],
                         "answer": ["1" if i % 3 else "2" for i in range(48)]})
    rows.to_json(path, orient="records", lines=True)
    return str(path)


@pytest.fixture
def one_thread():
    """One thread in this process for the test: a fixed reduction order, for comparisons at 1e-5 of the values
    compared or token for token. The files that compare so name it for all their tests (`pytestmark`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mlflow_client():
    from runtime import tracking

    return tracking.client()


@pytest.fixture(scope="session")
def gsm8k_copy(tmp_path_factory) -> Path:
    """A local copy laid out as the hub's openai/gsm8k (subset `main`, splits train and test, Parquet files), so
    `load_dataset(folder, "main", split=...)` reads it as it reads the hub's."""
    import pandas as pd

    root = tmp_path_factory.mktemp("gsm8k")
    (root / "main").mkdir()
    pd.DataFrame(gsm8k_rows(20)).to_parquet(root / "main" / "train-00000-of-00001.parquet")
    pd.DataFrame(gsm8k_rows(8, start=100)).to_parquet(root / "main" / "test-00000-of-00001.parquet")
    (root / "README.md").write_text(GSM8K_README)
    return root


@pytest.fixture(scope="session")
def bwrap():
    """Skip (fail in CI) where bubblewrap cannot run a sandbox: the code reward's tests need it."""
    from grpo.rewards.sandbox import BWRAP_INSTALL, SandboxUnavailable, check_sandbox

    try:
        check_sandbox()
    except SandboxUnavailable as e:
        reason = f"needs a working bubblewrap: {BWRAP_INSTALL} ({e})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: `make test` installs it as root; see its output)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def logged_checkpoint(prefect_harness, tmp_path_factory) -> str:
    """A tiny model (hidden 64, 2 layers) logged as a finished stage run's checkpoint artifact: the URI a stage that
    starts from an earlier one's model is given."""
    import torch

    from grpo.configs.model import ModelConfig
    from grpo.models import load_model_and_tokenizer
    from runtime import tracking

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("logged-checkpoint")
    model, tokenizer = load_model_and_tokenizer(ModelConfig.model_validate({"tiny": LOGGED_TINY}))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    run_id = tracking.start_run("checkpoint", tags={"stage": "sft"})
    uri = tracking.log_dir(run_id, folder, "checkpoint")
    tracking.end_run(run_id)
    return uri
