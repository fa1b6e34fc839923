"""Does asynchronous GRPO learn as well as synchronous? The tiny recipe's reasoning stage, sync against async.

usage: python benchmarks/async_learning.py [--settings sync,1,2,4] [--seeds 3] [--steps 80] [--out DIR]
                                           [--checkpoint PATH|runs:/<id>/checkpoint] [--cores 2] [--window W]

The full run, 4 settings x 3 seeds x 80 steps (about 35 minutes on a quiet 2-core machine: the cold start ~4 min,
each run ~30 s of stage around ~1.1-1.5 s a step; more where other jobs share the cores):
    .venv/bin/python benchmarks/async_learning.py --out /tmp/async-learning

What it runs. One cold-start checkpoint: the tiny recipe's `cold_start_sft` stage, trained once by
`r1 stage cold_start_sft --recipe tiny` (its runs:/ URI is kept in DIR/cold_start.json and its run in DIR/home, so a
rerun with the same --out skips it), or `--checkpoint` (a model folder, or a runs:/ URI read from the tracking store
of the calling environment and copied to DIR/checkpoint once). From it, the tiny recipe's `reasoning_grpo` stage,
each run a process of its own through the CLI (`r1 stage reasoning_grpo --recipe tiny --checkpoint URI --set ...`),
one after another, for every setting x seed:
- **sync**: `grpo.rollout.mode sync`: one process on both cores (torch threads = `--cores`, 2): each step samples,
  scores, then trains;
- **k** (an integer): `grpo.rollout.mode async`, `max_staleness k`, one worker (`workers 1`) with `threads 1`,
  `sync_every 1`: the worker samples step s with weights at most k optimizer steps old while the trainer trains;
  the loop sets the trainer's threads to the cores the worker leaves (`--cores` - 1).
The seeds: `grpo.seed` 0..N-1, which is all that draws at random in the stage: the prompts of each step
(`prompt_order`) and the sampling (`sampling_seed`), the same in the worker as in the synchronous loop; the
weights come from the checkpoint, the held-out evaluation is greedy, and the training problems
(`data.task.seed`, the recipe's 1) are held fixed, so every run trains on the same problem set.
Every run has the same overrides but those: `grpo.max_steps` `--steps`, `grpo.checkpoint_every 0` (a run is never
resumed from another's checkpoint, and no run pays for saving one), `eval_before false` (the starting checkpoint's
held-out accuracy is the same for every run: the cold start's, printed once when this script trained it); the rest
is the recipe's (8 prompts x 8 completions a step, 48 new tokens, learning rate 5e-5, beta 0.04, 200 held-out
prompts). Each run's process runs on `--cores` cores (its affinity, where the machine has more) with
OMP_NUM_THREADS = `--cores`, under an R1_HOME of its own (DIR/home: MLflow's SQLite and Prefect's local API there,
on 127.0.0.1), with the hub offline; nothing of the user's .r1 is touched.

What it reports, per run (one line as each ends, and DIR/runs/<setting>-seed<k>-steps<N>.json; a rerun with the same
--out reuses these and runs only what is missing):
- `acc`: held-out accuracy after training, the stage's `eval/accuracy` (greedy pass@1 on the recipe's 200
  held-out prompts);
- `loop_s`: wall time of the GRPO loop, from the start of its first step to the end of its last: the last step's
  metrics timestamp - the first's + the first step's `time/step_s` (async: the worker's start-up falls inside the
  first step, which waits for it); `step`: the median `time/step_s` (a step's own time, which a burst of another
  job's load moves less than the sum); `stage`: the whole `r1 stage` process (Prefect's API, data, model load,
  evaluation, artifacts);
- `others`: the cores other jobs kept busy during the run, on average (the machine's busy CPU time from /proc/stat
  less the run's own processes', over its wall time): above ~0.1 the run's wall times measure the contention more
  than the setting (a 2-thread sync step was seen to take 10-40x its quiet time while another job ran), an async
  run's staleness moves with it too, and the summary names those runs;
- `reward`: the final training reward, the mean `reward/total` (accuracy 1.0 + format 0.5) over the last `--window`
  steps, and `batch_acc`, the same for `reward/accuracy`; `stale`: the mean `async/staleness_mean`.
The stage scores the held-out split only before and after training (flows/reasoning_grpo.py), so there is no
held-out curve: the time-to-target figures come from the training reward curve instead. The target is the sync runs'
mean final reward; a run reaches it at the first step whose trailing `--window`-step mean `reward/total` is at least
that (`steps_to` and `s_to`, the loop's wall time at that step; "-" where it never does). An async run's reward at
step s is that of completions sampled up to k steps earlier, so its curve lags its weights by up to k steps.

Then, per setting: the mean and spread (sample standard deviation, and min-max) of the final held-out accuracy over
the seeds, the gap to sync's mean in points, the mean loop wall time, median step time and stage wall time, the
mean final reward, the runs that reached the target and their mean steps and loop seconds to it. Everything also
goes to DIR/summary.json. CPU timings: quote the `lscpu` model and the load average printed at the start and end,
and the runs the summary names as contended.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
R1 = [str(Path(sys.executable).with_name("r1"))] if Path(sys.executable).with_name("r1").exists() else \
    [sys.executable, "-m", "flows.cli"]
STAGE_LINE = re.compile(r"^\s*(\w+)\s+run ([0-9a-f]{32})\b", re.M)  # `r1 stage`'s summary line: "  <stage>  run <id>"


def cpu_line() -> str:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return f"cpu {model or '?'}, {os.cpu_count()} cores, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"


def stage_env(home: Path, cores: int) -> dict[str, str]:
    """The environment of every `r1` process: the isolated home, no tracking or Prefect server, the hub offline."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "PREFECT_", "R1_")) and k.lower() not in ("http_proxy", "https_proxy",
                                                                                   "all_proxy")}
    env.update({"R1_HOME": str(home), "OMP_NUM_THREADS": str(cores), "MKL_NUM_THREADS": str(cores),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "NO_PROXY": "127.0.0.1,localhost", "PYTHONUNBUFFERED": "1"})
    return env


def pin(cores: int):
    """preexec_fn: the process (and what it starts) on the first `cores` of the cores it may use."""
    def _pin() -> None:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) > cores:
            os.sched_setaffinity(0, allowed[:cores])
    return _pin if hasattr(os, "sched_setaffinity") else None


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (/proc/stat: all but idle and iowait; steal,
    the hypervisor's, counted as busy); 0 where there is no /proc/stat."""
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """CPU seconds of this process's finished children and their descendants (the `r1` process, its Prefect API,
    its rollout workers)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_r1(args: list[str], env: dict[str, str], log: Path, cores: int) -> tuple[str, float, float]:
    """`r1 <args>` to completion, its output to `log`; (the stage run id it printed, the process's wall seconds,
    the cores other jobs kept busy meanwhile on average: the machine's busy CPU time less the run's, over the wall
    time)."""
    t0, busy0, ours0 = time.perf_counter(), machine_busy_s(), children_cpu_s()
    with log.open("w") as f:
        rc = subprocess.run(R1 + args, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            preexec_fn=pin(cores)).returncode
    wall = time.perf_counter() - t0
    others = max(0.0, (machine_busy_s() - busy0) - (children_cpu_s() - ours0)) / wall
    text = log.read_text(errors="replace")
    found = [m.group(2) for m in STAGE_LINE.finditer(text) if m.group(1) == args[1]]
    if rc != 0 or not found:
        tail = "\n".join(text.splitlines()[-15:])
        raise SystemExit(f"r1 {' '.join(args)} failed (exit {rc}); its output is in {log}:\n{tail}")
    return found[-1], wall, others


def mlflow_client(home: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")


def cold_start(args, out: Path, home: Path, env: dict[str, str]) -> dict:
    """The checkpoint every run starts from: --checkpoint, or the tiny recipe's cold start trained once in `home`."""
    if args.checkpoint:
        if args.checkpoint.startswith("runs:/"):  # read from the caller's own store, once, into a local folder
            dst = out / "checkpoint"
            if not (dst / ".complete").exists():
                code = ("import sys; from pathlib import Path; from runtime import tracking; "
                        "print(tracking.download(sys.argv[1], Path(sys.argv[2])))")
                folder = subprocess.run([sys.executable, "-c", code, args.checkpoint, str(dst)], cwd=ROOT, text=True,
                                        capture_output=True, check=True).stdout.strip().splitlines()[-1]
                (dst / ".complete").write_text(folder)
            return {"checkpoint": (dst / ".complete").read_text(), "given": args.checkpoint}
        return {"checkpoint": str(Path(args.checkpoint).resolve()), "given": args.checkpoint}
    cached = out / "cold_start.json"
    if cached.exists():
        info = json.loads(cached.read_text())
        try:
            if mlflow_client(home).get_run(info["run_id"]).info.status == "FINISHED":
                print(f"cold start: {info['checkpoint']} (cached; held-out accuracy {info.get('accuracy')})",
                      flush=True)
                return info
        except Exception:  # the home was removed since: train it again
            pass
    print("cold start: training the tiny recipe's cold_start_sft stage ...", flush=True)
    run_id, wall, _ = run_r1(["stage", "cold_start_sft", "--recipe", "tiny"], env, out / "logs" / "cold_start_sft.log",
                          args.cores)
    metrics = mlflow_client(home).get_run(run_id).data.metrics
    info = {"run_id": run_id, "checkpoint": f"runs:/{run_id}/checkpoint", "accuracy": metrics.get("eval/accuracy"),
            "pass_at_k": metrics.get("eval/pass_at_k"), "stage_s": round(wall, 1)}
    cached.write_text(json.dumps(info, indent=1))
    print(f"cold start: {info['checkpoint']} in {wall:.0f} s; held-out accuracy {info['accuracy']} "
          f"(the starting point of every run: the same held-out rows)", flush=True)
    return info


def overrides(setting: str, seed: int, steps: int) -> list[str]:
    """The run's --set flags: the same for every run but the rollout mode, its staleness, and the seed."""
    sets = {"grpo.max_steps": steps, "grpo.seed": seed, "grpo.checkpoint_every": 0, "eval_before": "false",
            "grpo.rollout.workers": 1, "grpo.rollout.threads": 1, "grpo.rollout.sync_every": 1}
    if setting == "sync":
        sets["grpo.rollout.mode"] = "sync"
    else:
        sets.update({"grpo.rollout.mode": "async", "grpo.rollout.max_staleness": int(setting)})
    out = []
    for key, value in sets.items():
        out += ["--set", f"reasoning_grpo.{key}={value}"]
    return out


def trailing(values: list[float], window: int) -> list[float | None]:
    """The mean of the `window` values ending at each index (None before the first full window)."""
    return [None if i + 1 < window else statistics.fmean(values[i + 1 - window:i + 1]) for i in range(len(values))]


def run_figures(client, run_id: str, window: int) -> dict:
    """A finished stage run's figures, read back from its MLflow run."""
    run = client.get_run(run_id)

    def history(name: str) -> list:
        return sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)

    reward, batch_acc, step_s = history("reward/total"), history("reward/accuracy"), history("time/step_s")
    stale = history("async/staleness_mean")
    t0 = reward[0].timestamp / 1000 - step_s[0].value  # the start of the first step
    return {
        "run_id": run_id,
        "accuracy": run.data.metrics.get("eval/accuracy"),
        "loop_s": reward[-1].timestamp / 1000 - t0,
        "step_s": statistics.median(m.value for m in step_s),
        "final_reward": statistics.fmean(m.value for m in reward[-window:]),
        "final_batch_accuracy": statistics.fmean(m.value for m in batch_acc[-window:]) if batch_acc else None,
        "staleness_mean": statistics.fmean(m.value for m in stale) if stale else 0.0,
        # the curve: (step, reward/total, seconds since the loop started)
        "curve": [(m.step, m.value, round(m.timestamp / 1000 - t0, 3)) for m in reward],
    }


def reach(curve: list, target: float, window: int) -> tuple[int | None, float | None]:
    """The first step whose trailing mean reward is at least `target`, and the loop's seconds then."""
    smooth = trailing([r for _, r, _ in curve], window)
    for (step, _, t), s in zip(curve, smooth):
        if s is not None and s >= target:
            return step, t
    return None, None


def load_cached(path: Path, checkpoint: str, window: int) -> dict | None:
    """A run's figures an earlier invocation wrote, if they are of this start and window and have every field."""
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    ok = r.get("checkpoint") == checkpoint and r.get("window") == window and "others_cores" in r
    return r if ok else None


def fmt(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="sync,1,2,4",
                    help="comma-separated: sync, and async max_staleness values (default: sync,1,2,4)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per setting: grpo.seed 0..N-1 (default: 3)")
    ap.add_argument("--steps", type=int, default=80, help="GRPO optimizer steps per run (default: 80)")
    ap.add_argument("--out", default=None, help="output folder, reused by a rerun (default: a new temporary one)")
    ap.add_argument("--checkpoint", default=None,
                    help="the starting model: a folder or runs:/<id>/checkpoint (default: train the tiny cold start)")
    ap.add_argument("--cores", type=int, default=2, help="cores each run computes on (default: 2)")
    ap.add_argument("--window", type=int, default=None,
                    help="steps in the trailing mean of the training reward (default: steps // 5, at least 3)")
    args = ap.parse_args()
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in settings:
        if s != "sync" and not s.isdigit():
            ap.error(f"--settings: {s!r} is neither sync nor a max_staleness (an integer >= 0)")
    window = args.window or min(args.steps, max(3, args.steps // 5))
    if window > args.steps:
        ap.error(f"--window {window} is longer than --steps {args.steps}")

    out = Path(args.out or tempfile.mkdtemp(prefix="async-learning-")).resolve()
    home = out / "home"
    for folder in (home, out / "logs", out / "runs"):
        folder.mkdir(parents=True, exist_ok=True)
    env = stage_env(home, args.cores)
    print(cpu_line(), flush=True)
    print(f"output in {out}; {args.steps} steps a run, seeds 0..{args.seeds - 1}, settings {settings}, "
          f"reward window {window} steps, {args.cores} cores a run", flush=True)
    start = cold_start(args, out, home, env)
    client = mlflow_client(home)

    results: dict[str, list[dict]] = {}
    t_all = time.perf_counter()
    for setting in settings:
        for seed in range(args.seeds):
            name = f"{setting}-seed{seed}-steps{args.steps}"
            path = out / "runs" / f"{name}.json"
            cached = load_cached(path, start["checkpoint"], window)
            if cached:
                r, how = cached, "cached"
            else:
                run_id, wall, others = run_r1(["stage", "reasoning_grpo", "--recipe", "tiny", "--checkpoint",
                                       start["checkpoint"], *overrides(setting, seed, args.steps)],
                                      env, out / "logs" / f"{name}.log", args.cores)
                r = {"setting": setting, "seed": seed, "steps": args.steps, "checkpoint": start["checkpoint"],
                     "window": window, "stage_s": wall, "others_cores": others, **run_figures(client, run_id, window)}
                path.write_text(json.dumps(r))
                how = f"{time.perf_counter() - t_all:.0f} s in"
            results.setdefault(setting, []).append(r)
            print(f"{setting:>4} seed {seed}: acc {r['accuracy']:.3f}  loop {r['loop_s']:6.1f} s  "
                  f"step {r['step_s']:.2f} s  stage {r['stage_s']:6.1f} s  reward {r['final_reward']:.3f}  batch_acc "
                  f"{fmt(r['final_batch_accuracy'])}  stale {r['staleness_mean']:.2f}  others "
                  f"{r['others_cores']:.2f} cores  ({how})", flush=True)

    # the target: the sync runs' mean final reward (this invocation's, else those an earlier one left in --out)
    sync = results.get("sync") or [r for p in sorted((out / "runs").glob(f"sync-seed*-steps{args.steps}.json"))
                                    if (r := load_cached(p, start["checkpoint"], window))]
    sync_acc = statistics.fmean(r["accuracy"] for r in sync) if sync else None
    target = statistics.fmean(r["final_reward"] for r in sync) if sync else None

    print()
    if start.get("accuracy") is not None:
        print(f"start (cold start) held-out accuracy {start['accuracy']:.3f}")
    if target is None:
        print("no sync runs in --settings or in --out: no gaps to sync and no reward target")
    else:
        print(f"reward target: the sync runs' mean final reward (reward/total, last {window} steps) {target:.3f}; "
              f"held-out accuracy is scored only after training, so the time to it is read from the training "
              f"reward curve")
    header = (f"{'setting':>8} {'runs':>4} {'acc mean':>8} {'sd':>6} {'min-max':>11} {'gap pts':>7} {'loop s':>7} "
              f"{'step s':>6} {'stage s':>7} {'reward':>6} {'reached':>7} {'steps to':>8} {'s to':>6}")
    print(header)
    summary = {"settings": settings, "steps": args.steps, "seeds": args.seeds, "window": window,
               "start": start, "target_reward": target, "sync_accuracy": sync_acc, "per_setting": {}}
    for setting, runs in results.items():
        accs = [r["accuracy"] for r in runs]
        hits = [reach(r["curve"], target, window) for r in runs] if target is not None else []
        hit = [h for h in hits if h[0] is not None]
        row = {
            "runs": len(runs), "accuracy_mean": statistics.fmean(accs),
            "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "accuracy_min": min(accs), "accuracy_max": max(accs),
            "gap_points": None if sync_acc is None else 100 * (statistics.fmean(accs) - sync_acc),
            "loop_s_mean": statistics.fmean(r["loop_s"] for r in runs),
            "step_s_mean": statistics.fmean(r["step_s"] for r in runs),
            "stage_s_mean": statistics.fmean(r["stage_s"] for r in runs),
            "final_reward_mean": statistics.fmean(r["final_reward"] for r in runs),
            "reached": len(hit) if target is not None else None,
            "steps_to_mean": statistics.fmean(h[0] for h in hit) if hit else None,
            "s_to_mean": statistics.fmean(h[1] for h in hit) if hit else None,
            "runs_detail": [{"seed": r["seed"], "accuracy": r["accuracy"], "loop_s": r["loop_s"],
                             "final_reward": r["final_reward"], "steps_to": h[0], "s_to": h[1], "run_id": r["run_id"]}
                            for r, h in zip(runs, hits or [(None, None)] * len(runs))],
        }
        summary["per_setting"][setting] = row
        label = "sync" if setting == "sync" else f"async {setting}"
        reached = "-" if target is None else f"{row['reached']}/{row['runs']}"
        print(f"{label:>8} {row['runs']:>4} {row['accuracy_mean']:8.3f} {row['accuracy_sd']:6.3f} "
              f"{row['accuracy_min']:.3f}-{row['accuracy_max']:.3f} {fmt(row['gap_points'], '+7.1f'):>7} "
              f"{row['loop_s_mean']:7.1f} {row['step_s_mean']:6.2f} {row['stage_s_mean']:7.1f} "
              f"{row['final_reward_mean']:6.3f} {reached:>7} "
              f"{fmt(row['steps_to_mean'], '8.1f'):>8} {fmt(row['s_to_mean'], '6.1f'):>6}")
    busy = [f"{r['setting']} seed {r['seed']} ({r['others_cores']:.2f})" for runs in results.values() for r in runs
            if r["others_cores"] > 0.1]
    summary["contended_runs"] = busy
    if busy and (os.cpu_count() or 1) <= args.cores:
        print(f"\nother jobs kept more than 0.1 core busy on average during: {', '.join(busy)}; their wall times "
              f"(sync's most: its OpenMP threads stall when a core is taken) are not this machine's quiet ones, and "
              f"an async run's staleness, so its learning, moves with the sampler's and trainer's relative speed; "
              f"the step medians are less moved. Rerun them on a quiet machine (delete their files in "
              f"{out / 'runs'})")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{cpu_line()}; {time.perf_counter() - t_all:.0f} s for the runs; summary in {out / 'summary.json'}")


if __name__ == "__main__":
    main()
