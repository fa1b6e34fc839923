"""The rejection-sampling stage with its shard tasks on a real Ray cluster: a head and a second node on this machine.

The nodes have their own HOME, TMPDIR, R1_HOME and working folder, and (where the kernel allows a mount namespace)
the driver's folders are covered by an empty tmpfs on them: a shard task can only get the checkpoint and prompts
from the MLflow server (HTTP, `--serve-artifacts`) and write its shard to the shared store. The kept set must equal
the one-process (threads) run's with the same seed.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the driver keeps 127.0.0.1 too (before ray is imported)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.pop("RAY_ADDRESS", None)

from flows.cli import stack  # noqa: E402
from grpo.configs.recipe import RejectionSamplingConfig
from ray_local import LocalRayCluster  # noqa: E402
from answering import SMALL  # noqa: E402
from runs import curated  # noqa: E402

N_PROMPTS, SHARD_SIZE = 16, 4  # four shards


@pytest.fixture(scope="module")
def cluster(r1_home, tmp_path_factory):
    """A 2-node Ray cluster and an MLflow server, both on 127.0.0.1; the driver's folders hidden from the nodes."""
    root = Path(tempfile.mkdtemp(prefix="r1ray-", dir="/tmp"))  # short: Ray's unix socket paths live under it
    for d in ("driver/home", "driver/tmp", "driver/work", "shared", "mlflow"):
        (root / d).mkdir(parents=True)
    hidden = [root / "driver", root / "mlflow", r1_home, tmp_path_factory.getbasetemp()]
    ray = LocalRayCluster(root / "c", hide=hidden).start(n_nodes=2)
    mlflow = None
    try:
        mlflow, tracking_uri = stack.start_mlflow_server(root / "mlflow" / "mlflow.db", root / "mlflow" / "artifacts",
                                                         stack.free_port(), root / "mlflow")
        ray.wait_ready()
        yield {"ray": ray, "root": root, "tracking_uri": tracking_uri, "mlflow_port": tracking_uri.rsplit(":", 1)[1]}
    finally:
        stragglers = ray.stop()
        if mlflow is not None:
            stack.stop_process(mlflow)
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    assert not stragglers, f"processes left after stopping the nodes' groups: {stragglers}"


@pytest.fixture
def driver(cluster, monkeypatch):
    """This process as the driver: its own HOME, TMPDIR and cwd, and the MLflow server as its tracking URI."""
    d = cluster["root"] / "driver"
    monkeypatch.setenv("HOME", str(d / "home"))
    monkeypatch.setenv("TMPDIR", str(d / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(d / "tmp"))
    monkeypatch.chdir(d / "work")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", cluster["tracking_uri"])
    return d


def stage_config(prompts: str, **cluster) -> RejectionSamplingConfig:
    return RejectionSamplingConfig.model_validate({
        "model": {"tiny": SMALL.model_dump()},
        "data": {"source": prompts, "num_train": N_PROMPTS, "num_heldout": 0},
        "rejection": {"samples_per_prompt": 4, "sampling": {"max_new_tokens": 24}, "target_samples": 40,
                      "shard_size": SHARD_SIZE, "decontamination_ngram": 0, "seed": 7},
        "cluster": cluster,
    })


def logged_checkpoint(folder: str, tracking_uri: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.create_run(client.create_experiment(f"ray-{time.time_ns()}")).info.run_id
    client.log_artifacts(run, folder, "checkpoint")
    client.set_terminated(run)
    return f"runs:/{run}/checkpoint"


def prompts_file(driver: Path) -> str:
    path = driver / "work" / "prompts.jsonl"
    pd.DataFrame({"prompt": [f"Problem {i}: what is it?" for i in range(N_PROMPTS)],
                  "answer": ["1" if i % 3 else "2" for i in range(N_PROMPTS)]}).to_json(path, orient="records",
                                                                                        lines=True)
    return str(path)


def read_on_each_node(address: str, path: str) -> dict[str, str]:
    """Try to read `path` on every node of the cluster; the outcome per node (its TMPDIR names it)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read(p: str) -> tuple[str, str]:
        try:
            Path(p).read_bytes()
            outcome = "READABLE"
        except OSError as e:
            outcome = type(e).__name__
        return Path(tempfile.gettempdir()).parent.name, outcome

    ray.init(address=address)
    try:
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(path)
                for n in nodes]
        return dict(ray.get(refs, timeout=120))
    finally:
        ray.shutdown()


def test_shards_on_a_ray_cluster_keep_what_one_process_keeps(prefect_harness, cluster, driver,
                                                             answering_checkpoint):
    from flows.rejection_sampling import rejection_sampling

    ray, root = cluster["ray"], cluster["root"]
    checkpoint = logged_checkpoint(answering_checkpoint, cluster["tracking_uri"])
    prompts = prompts_file(driver)
    secret = driver / "home" / "driver-only.txt"
    secret.write_text("the driver's own file\n")

    alone = rejection_sampling(checkpoint, stage_config(prompts))  # threads of this process, local work folder
    store = f"file://{root}/shared/store"
    on_ray = rejection_sampling(checkpoint, stage_config(prompts, ray_address=ray.address, shard_store=store))

    expected = curated(alone.uris["dataset"])
    assert 0 < len(expected) < N_PROMPTS * 4  # the rule check kept some samples and dropped others
    pd.testing.assert_frame_equal(curated(on_ray.uris["dataset"]), expected)
    assert on_ray.metrics == alone.metrics

    # the shards are in the shared store, and each node downloaded the checkpoint into its own TMPDIR
    (folder,) = (root / "shared" / "store" / "rejection_sampling").iterdir()
    assert sorted(p.name for p in folder.glob("shard-*.parquet")) == [f"shard-{i:05d}.parquet" for i in range(4)]
    for node in ray.nodes:
        assert list((node.root / "tmp").glob("r1-checkpoint-*/checkpoint/config.json")), \
            f"no shard task ran on {node.name} (no checkpoint downloaded there)"
    # ...and none of them could have read the driver's files, which the driver itself reads
    if ray.namespace:
        assert secret.read_text() == "the driver's own file\n"
        assert read_on_each_node(ray.address, str(secret)) == {node.name: "FileNotFoundError" for node in ray.nodes}


def test_bad_cluster_settings_fail_before_any_shard_is_sampled(prefect_harness, cluster, driver,
                                                               answering_checkpoint, monkeypatch):
    from flows.rejection_sampling import rejection_sampling

    checkpoint = logged_checkpoint(answering_checkpoint, cluster["tracking_uri"])
    prompts = prompts_file(driver)
    store = cluster["root"] / "shared" / "bad"
    good = {"ray_address": cluster["ray"].address, "shard_store": f"file://{store}"}

    def fails(match: str, error: type[Exception], cfg: RejectionSamplingConfig, uri: str = checkpoint) -> None:
        started = time.monotonic()
        with pytest.raises(error, match=match):
            rejection_sampling(uri, cfg)
        assert time.monotonic() - started < 60  # ray.init against a dead address would hang for many minutes
        assert not list(store.glob("**/shard-*")), "a shard was sampled before the error"

    fails(r"no Ray cluster at '127.0.0.1:1': cannot connect", ConnectionError,
          stage_config(prompts, **{**good, "ray_address": "127.0.0.1:1"}))
    fails(r"is not a Ray GCS", ConnectionError,  # a live port, but the MLflow server's HTTP
          stage_config(prompts, **{**good, "ray_address": f"127.0.0.1:{cluster['mlflow_port']}"}))
    (cluster["root"] / "shared" / "a-file").write_text("not a folder")
    fails(r"shard store .*a-file/r1/rejection_sampling/\w+' is not writable", PermissionError,
          stage_config(prompts, **{**good, "shard_store": f"file://{cluster['root']}/shared/a-file/r1"}))
    fails(r"a local path the Ray nodes cannot read", ValueError, stage_config(prompts, **good),
          uri=answering_checkpoint)
    # the nodes declare no GPU: a shard asking for one could never start, so it is refused instead of waiting forever
    fails(r"gpus_per_shard is 1, but no node of the Ray cluster has that many GPUs \(per node: \['0', '0'\]\)",
          ValueError, stage_config(prompts, **good, gpus_per_shard=1))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fails(r"ray_address is 'auto' but RAY_ADDRESS is not set", ValueError,
          stage_config(prompts, **{**good, "ray_address": "auto"}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{driver / 'mlflow.db'}")
    fails(r"only this machine can read", ValueError, stage_config(prompts, **good))
    with pytest.raises(ValueError, match="ray_address needs a shard_store"):
        stage_config(prompts, ray_address="auto")


def test_shards_ask_for_a_gpu_each_where_the_cluster_has_them_and_they_load_a_model():
    from runtime.cluster import shard_gpus

    def cfg(**over) -> RejectionSamplingConfig:
        base = stage_config("prompts.jsonl", ray_address="127.0.0.1:6379", shard_store="file:///shared/r1")
        return base.model_validate({**base.model_dump(), **over})

    local = cfg()
    assert shard_gpus(local, [0.0, 8.0]) == 1.0  # one GPU node is enough
    assert shard_gpus(local, [0.0, 0.0]) == 0.0  # a CPU cluster: the shards sample on CPU
    served = cfg(generation={"backend": "http", "endpoints": ["http://127.0.0.1:9/v1"], "model": "m"})
    assert shard_gpus(served, [8.0]) == 0.0  # the servers generate: a shard only sends requests
    judged = served.model_validate({**served.model_dump(), "judge": {"backend": "transformers"}})
    assert shard_gpus(judged, [8.0]) == 1.0  # ...unless it loads a judge model
    packed = cfg(cluster={**local.cluster.model_dump(), "gpus_per_shard": 0.5})
    assert shard_gpus(packed, [1.0]) == 0.5
    with pytest.raises(ValueError, match=r"gpus_per_shard is 2, but no node .* \(per node: \['1', '1'\]\)"):
        shard_gpus(cfg(cluster={**local.cluster.model_dump(), "gpus_per_shard": 2}), [1.0, 1.0])
    with pytest.raises(ValueError, match="gpus_per_shard is -1"):
        cfg(cluster={**local.cluster.model_dump(), "gpus_per_shard": -1})


def test_the_pipeline_s_cluster_parameters_override_the_recipe():
    from pydantic import ValidationError

    from flows.r1_pipeline import with_cluster
    from grpo.configs.recipe import load_recipe
    from grpo.configs.rejection import ClusterConfig

    cfg = with_cluster(load_recipe("tiny"), "head:6379", "s3://bucket/r1")
    assert cfg.rejection_sampling.cluster == ClusterConfig(ray_address="head:6379", shard_store="s3://bucket/r1")
    assert with_cluster(cfg, None, "file:///mnt/r1").rejection_sampling.cluster == ClusterConfig(
        ray_address="head:6379", shard_store="file:///mnt/r1")
    with pytest.raises(ValidationError, match="ray_address needs a shard_store"):
        with_cluster(load_recipe("tiny"), "auto", None)


def test_the_merge_reads_the_shards_on_both_nodes_and_writes_what_reading_here_writes(cluster, driver):
    """The merge's reads through Ray Data on the cluster's two nodes: the same files as reading every shard here;
    a bad shard file is the same one-line error, naming it, as here."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray as ray_api

    from grpo.data.tables import DataError
    from grpo.rejection.curate import build_heldout_index
    from grpo.rejection.merge import write_merged
    from grpo.rejection.ray_reader import RayDataReader
    from shard_files import CFG, HELDOUT, NON_REASONING, tiny_shards

    store = cluster["root"] / "shared" / f"merge-{time.time_ns()}"  # every node reads it; the driver's are hidden
    tiny_shards(store, build_heldout_index(HELDOUT, CFG.decontamination_ngram, CFG.decontamination_threshold))
    here = write_merged(store, CFG, store / "here", HELDOUT, NON_REASONING, num_shards=5)
    reader = RayDataReader()
    ray_api.init(address=cluster["ray"].address)
    try:
        there = write_merged(store, CFG, store / "there", HELDOUT, NON_REASONING, num_shards=5, reader=reader)
        assert (there.counts, there.rows, there.non_reasoning) == (here.counts, here.rows, here.non_reasoning)
        assert len(there.files) == len(here.files)  # the same rows, columns and types, in the same order
        assert pa.concat_tables(map(pq.read_table, there.files)).equals(pa.concat_tables(map(pq.read_table, here.files)))
        assert sum(reader.nodes.values()) == 5 and len(reader.nodes) == 2, reader.nodes  # both nodes read shards
        # a row without its sample index, found by the node that reads the shard's keys
        table = pq.read_table(store / "shard-00003.parquet")
        column = table.column("sample_index").to_pylist()
        column[7] = None
        pq.write_table(table.set_column(table.schema.get_field_index("sample_index"), "sample_index",
                                        pa.array(column)), store / "shard-00003.parquet")
        with pytest.raises(DataError, match=r"^\S*shard-00003\.parquet: row 7, column 'sample_index': empty") \
                as caught:
            write_merged(store, CFG, store / "bad", HELDOUT, num_shards=5, reader=RayDataReader())
        assert "Traceback" not in str(caught.value)  # the node's error, not Ray's wrapper of it
    finally:
        ray_api.shutdown()
