"""The house rules a newcomer relies on: imports point one way, no import circle, no module grows past ~500 lines,
an optional library loads only where a recipe or command uses it, and each package's map lists its modules."""

from __future__ import annotations

import ast
import itertools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "grpo"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The project modules a file imports, at the top or inside a function (a deferred import is still an edge: it
    runs when the function does, and a circle through one is a circle a newcomer must hold in mind)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from grpo.training.launchers import launch` imports the module grpo.training.launchers.launch
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.split(".")[0] in ("grpo", "runtime", "tasks", "flows")}


def _import_graph() -> dict[str, set[str]]:
    files = [p for d in ("grpo", "runtime", "tasks", "flows") for p in (ROOT / d).rglob("*.py")]
    graph = {_module(p): _imports(p) for p in files}
    # `from a.b import name` also listed a.b.name, which is a module only where a file has that name
    return {module: (deps & graph.keys()) - {module} for module, deps in graph.items()}


def test_grpo_imports_neither_prefect_nor_mlflow_nor_a_web_framework():
    # the core is a library: `r1 serve`'s HTTP app lives beside the command (flows/cli/serve.py)
    modules = sorted(_module(p) for p in GRPO.rglob("*.py"))
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'prefect', 'mlflow', 'runtime', 'tasks', 'flows', "
            "'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_reading_a_recipe_imports_no_torch():
    code = ("import sys; from grpo.configs.recipe import load_recipe; load_recipe('tiny'); "
            "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


OPTIONAL = ("bitsandbytes", "peft", "ray", "selenium")  # extras: LoRA, 8-bit AdamW, Ray shards, the UI's browser


def test_a_stage_loads_no_optional_library_it_does_not_use(tmp_path):
    """Every project module, then a GRPO step on a tiny model as a stage runs it: none of the optional libraries is
    imported, so none prints its warnings (bitsandbytes, once loaded, warns about CPU kernels it cannot find)."""
    modules = sorted(_module(p) for d in ("grpo", "runtime", "tasks", "flows") for p in (ROOT / d).rglob("*.py"))
    code = f"""
import importlib, sys
import pandas as pd
for m in {modules!r}:
    importlib.import_module(m)
from transformers import AutoModelForCausalLM
from grpo.configs.model import ModelConfig, TinyModelConfig
from grpo.configs.sampling import SamplingConfig
from grpo.configs.training import GRPOConfig
from grpo.models import load_model_and_tokenizer
from grpo.rewards import REWARD_FUNCTIONS
from grpo.training.loops.grpo_trainer import GRPOTrainer
tiny = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1)
model, tok = load_model_and_tokenizer(ModelConfig(tiny=tiny))
cfg = GRPOConfig(max_steps=1, prompts_per_step=2, num_generations=2, checkpoint_every=0, mixed_precision="no",
                 sampling=SamplingConfig(max_new_tokens=4))
prompts = pd.DataFrame({{"prompt": ["Say 1", "Say 2"], "answer": ["1", "2"]}})
result = GRPOTrainer(model, tok, prompts, cfg, {str(tmp_path)!r}, reward_functions=REWARD_FUNCTIONS,
                     progress=False).train()
AutoModelForCausalLM.from_pretrained(result.model_dir)
print(sorted({{n.split(".")[0] for n in sys.modules}} & {set(OPTIONAL)!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    assert "bitsandbytes" not in out.stderr, out.stderr[-3000:]


def test_no_import_circle_in_the_project():
    """No module reaches, through any chain of imports (at the top or inside functions), back to itself."""
    graph = _import_graph()
    # importing a.b.c runs a/__init__ and a/b/__init__ first: an edge to each parent package too, except to the
    # importer's own packages, which are running already when it is imported. A package it names stays an edge:
    # `from a import c` inside a.b reads a's namespace, which a/__init__ fills only once what it imports has run
    for module, deps in graph.items():
        for m in list(deps):
            parts = m.split(".")
            parents = (".".join(parts[:i]) for i in range(1, len(parts)))
            deps.update(p for p in parents if not module.startswith(p + "."))
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep not in graph or dep == node:
                continue
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


LOOPS = "grpo.training.loops"
LAUNCHERS = "grpo.training.launchers"
JOBS = "grpo.training.jobs"  # the job runner: builds a loop from its job; what launchers start


def test_training_is_parts_loops_the_job_runner_and_launchers():
    """`grpo/training/` holds loops (`loops/`), the job runner that builds one from its job (`jobs.py`), what starts
    them (`launchers/`) and the parts they share (loose): no loop imports another loop, the job runner, or a
    launcher; the job runner imports no launcher; parts import none of loops, the job runner and launchers."""
    graph = _import_graph()
    assert any(m.startswith(LOOPS + ".") for m in graph), f"{LOOPS} holds the training loops"
    assert any(m.startswith(LAUNCHERS + ".") for m in graph), f"{LAUNCHERS} holds what starts them"
    assert any(dep.startswith(LOOPS + ".") for dep in graph[JOBS]), f"{JOBS} builds the loops"
    wrong = []
    for module, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if module.startswith(LOOPS + ".") and dep.startswith(LOOPS + ".") and dep != module:
                wrong.append(f"loop {module} imports loop {dep}")
            elif module.startswith(LOOPS + ".") and (dep.startswith(LAUNCHERS) or dep == JOBS):
                wrong.append(f"loop {module} imports {dep}")
            elif module == JOBS and dep.startswith(LAUNCHERS):
                wrong.append(f"the job runner imports launcher {dep}")
            elif (module.startswith("grpo.") and not module.startswith((LOOPS, LAUNCHERS)) and module != JOBS
                  and (dep.startswith((LOOPS + ".", LAUNCHERS + ".")) or dep == JOBS)):
                wrong.append(f"part {module} imports {dep}")
    assert not wrong, "\n".join(wrong)


TRANSPORTS = ("grpo.training.rollouts.processes", "grpo.training.rollouts.ray_actors", "grpo.training.rollouts.start")


def test_the_grpo_loop_is_handed_its_rollouts_and_starts_no_transport():
    """The GRPO loop takes its groups from a rollout source built outside it (grpo.training.sources): it imports no
    sampler transport, directly or inside a function, so starting processes or Ray actors is never the loop's."""
    graph = _import_graph()
    loop = LOOPS + ".grpo_trainer"
    wrong = sorted(dep for dep in graph[loop] if dep.startswith(TRANSPORTS))
    assert not wrong, f"{loop} imports {wrong}"


def test_no_module_over_about_500_lines():
    files = [p for d in ("grpo", "runtime", "tasks", "flows", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    long = {str(p.relative_to(ROOT)): n for p in files if (n := len(p.read_text().splitlines())) > 520}
    assert not long, f"split these by what they do: {long}"


def _project_files() -> list[Path]:
    return [p for d in ("grpo", "runtime", "tasks", "flows") for p in (ROOT / d).rglob("*.py")]


def test_no_private_name_is_imported_from_another_module():
    """A name with a leading underscore is its module's own: another module that needs it gets a public name, so a
    reader can tell a module's interface from its insides."""
    private = []
    for path in _project_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] in ("grpo", "runtime", "tasks", "flows"):
                private += [f"{path.relative_to(ROOT)}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not private, "\n".join(private)


LOCAL = "grpo.sampling.local"


def test_the_local_engine_is_used_through_its_package():
    """Outside `grpo/sampling/local/`, the engine's modules are reached through what the package exports, so its
    insides (slots, decode step, pages, kernels) can change without touching the stages, the server or the workers."""
    graph = _import_graph()
    assert any(m.startswith(LOCAL + ".") for m in graph), f"{LOCAL} holds the local engine"
    inside = [f"{module} imports {dep}" for module, deps in sorted(graph.items())
              if not module.startswith(LOCAL) for dep in sorted(deps) if dep.startswith(LOCAL + ".")]
    assert not inside, "\n".join(inside)


CONFIGS = "grpo.configs"
LEAVES = ("grpo.texts",)  # modules that import nothing of the project, which configs may use


def test_configs_import_nothing_above_them():
    """`grpo/configs/` is the ground floor: its modules import only each other and the leaves (which import nothing
    of the project), so every layer can import a config and no config drags in rewards, torch or a stage."""
    graph = _import_graph()
    assert any(m.startswith(CONFIGS + ".") for m in graph), f"{CONFIGS} holds the configs"
    wrong = [f"{module} imports {dep}" for module, deps in sorted(graph.items()) if module.startswith(CONFIGS)
             for dep in sorted(deps) if not dep.startswith(CONFIGS) and dep not in LEAVES]
    wrong += [f"leaf {leaf} imports {dep}" for leaf in LEAVES for dep in sorted(graph[leaf])]
    assert not wrong, "\n".join(wrong)


def test_tasks_hold_tasks_and_runtime_what_they_run_inside():
    """`tasks/` holds Prefect tasks: each of its modules defines one or more. What they run inside (tracking, the
    home, heartbeats, durable copies, reports) is `runtime/`, which imports neither a task nor a flow."""
    no_task = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tasks").glob("*.py")) if p.name != "__init__.py"
               and not any(isinstance(d, ast.Name) and d.id == "task" or isinstance(d, ast.Call)
                           and isinstance(d.func, ast.Name) and d.func.id == "task"
                           for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.FunctionDef)
                           for d in node.decorator_list)]
    assert not no_task, f"modules in tasks/ that define no Prefect task (their place is runtime/): {no_task}"
    graph = _import_graph()
    wrong = [f"{module} imports {dep}" for module, deps in sorted(graph.items()) if module.split(".")[0] == "runtime"
             for dep in sorted(deps) if dep.split(".")[0] in ("tasks", "flows")]
    assert not wrong, "\n".join(wrong)


def mapped_modules(package: Path) -> list[str]:
    """The names in the first column of the `| module | ... |` table in a package's docstring (several to a row, as
    `` `ppo`, `value` ``), a subpackage's with or without its trailing slash."""
    lines = (ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| module |")), len(lines))
    rows = itertools.takewhile(lambda line: line.startswith("| "), lines[start + 2:])  # the header's and rule's after
    return [name.rstrip("/") for row in rows for name in re.findall(r"`(\w+/?)`", row.split(" | ")[0])]


def test_every_grpo_package_maps_exactly_its_modules():
    """The table in each package's docstring is where a newcomer looks for a module: every module and subpackage of
    the package is in it once, and nothing that is not there any more."""
    wrong = []
    for init in sorted(GRPO.rglob("__init__.py")):
        package = init.parent
        modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"} | \
                  {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
        mapped = mapped_modules(package)
        where = init.relative_to(ROOT)
        if not mapped:
            wrong.append(f"{where}: no `| module | what it holds |` table")
            continue
        wrong += [f"{where}: no row for {m}" for m in sorted(modules - set(mapped))]
        wrong += [f"{where}: a row for {m}, which is not in {package.relative_to(ROOT)}/"
                  for m in sorted(set(mapped) - modules)]
        wrong += [f"{where}: {m} in two rows" for m in sorted({m for m in mapped if mapped.count(m) > 1})]
    assert not wrong, "\n".join(wrong)
