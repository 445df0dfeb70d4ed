"""Package structure: no import cycles, the runtime never loads test-only code, the seed API holds."""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import numpy as np
from support.paths import REPO

PACKAGE = REPO / "mtplx"

# Test and tool code the runtime path must never import.
TEST_ONLY_MODULES = ("mtplx.sampling", "mtplx.sample.reference", "mtplx.sample.emulation")
# Commands, not the engine's business: loading a model must not pull them in. (The default model's
# GGUF conversion in mtplx.checkpoints is not one: it runs on first load.)
COMMAND_PACKAGES = ("mtplx.bench", "mtplx.forge", "mtplx.cli")
# Head modules that are not a family's: the protocol, the shared loader, the registry, discovery.
HEAD_INFRASTRUCTURE = (
    "mtplx.heads",
    "mtplx.heads.base",
    "mtplx.heads.registry",
    "mtplx.heads.weights",
    "mtplx.heads.discovery",
)
MAX_MODULE_LINES = 600


@functools.cache
def _nodes_of(text: str, filename: str) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(ast.parse(text, filename)))


def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s syntax tree (`ast.walk`'s order), parsed and listed once per text: the
    checks below read the whole package about ten times (read only; never modify a node)."""
    return _nodes_of(path.read_text(), str(path))


def is_command_module(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in COMMAND_PACKAGES)


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere (function-level imports included).

    A package importing its own submodule (re-exports in __init__.py) is not an edge.
    """
    root_name = package_dir.name
    modules: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = (root_name, *path.relative_to(package_dir).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for node in nodes(path):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = name.split(".") if is_package else name.split(".")[:-1]
                    base_parts = base_parts[: len(base_parts) - node.level + 1]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name and not target.startswith(name + "."):
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the cycle it closes."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                cycles.append(stack[stack.index(successor) :] + [successor])
            elif successor not in state:
                visit(successor)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles_among_mtplx_modules() -> None:
    graph = import_graph(PACKAGE)
    assert len(graph) > 20 and "mtplx.engine.engine" in graph  # the walk saw the package
    assert find_cycles(graph) == []


def test_cycle_finder_catches_a_cycle(tmp_path: Path) -> None:
    """Negative control: a function-level import closing a loop is reported."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg import a\n")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert find_cycles(import_graph(package)) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_runtime_modules_do_not_import_test_code() -> None:
    """Static half of the check below: no runtime module names a test-only module at all."""
    graph = import_graph(PACKAGE)
    offenders = {
        name: sorted(graph[name] & set(TEST_ONLY_MODULES))
        for name in graph
        if name not in TEST_ONLY_MODULES and graph[name] & set(TEST_ONLY_MODULES)
    }
    assert offenders == {}


_GENERATE_AND_LIST_MODULES = """
import json, sys
import mtplx
from mtplx.engine.engine import Engine
engine = Engine.load()
assert engine.head is not None, "the default model ships a head"
mtp = engine.generate("Say hi.", max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=3, mtp=True)
greedy = engine.generate("Say hi.", max_tokens=8, mtp=True)
assert mtp.stats.cycles > 0 and greedy.stats.cycles > 0, "MTP did not run"
print(json.dumps(sorted(m for m in sys.modules if m.startswith("mtplx"))))
"""


def _modules_after(script: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mtp_generate_in_a_fresh_process_loads_no_test_or_command_code(default_model_dir) -> None:
    loaded = _modules_after(_GENERATE_AND_LIST_MODULES)
    assert (
        "mtplx.spec_decode.loop" in loaded
        and "mtplx.sample.rejection" in loaded
        and "mtplx.sample.ops" in loaded
    )  # the listing is the real one
    assert [name for name in loaded if name in TEST_ONLY_MODULES or is_command_module(name)] == []


def test_fresh_process_check_sees_an_oracle_import() -> None:
    """Negative control: a process that does import the oracle is caught by the same listing."""
    loaded = _modules_after(
        "import json, sys, mtplx, mtplx.sampling\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('mtplx'))))"
    )
    assert "mtplx.sampling" in loaded


_HEAVY = ("mlx.core", "mlx_lm", "transformers", "mtplx.forge.run", "mtplx.engine.engine")
_PARSER_AND_LIST_HEAVY = (
    "import json, sys\n"
    "from mtplx.cli.main import _build_parser\n"
    "_build_parser()\n"
    "{extra}"
    f"print(json.dumps([m for m in {_HEAVY!r} if m in sys.modules]))"
)


def test_cli_parser_imports_no_mlx_or_model_code() -> None:
    """`mtplx --help` and every argument error come before any model code: building the
    parser (forge's defaults included, from mtplx.forge.config) imports no MLX, mlx-lm or
    transformers (~2 s on the 2-core CPU)."""
    assert _modules_after(_PARSER_AND_LIST_HEAVY.format(extra="")) == []


def test_cli_parser_check_sees_a_heavy_import() -> None:
    """Negative control: the same listing after importing mtplx.forge.run names what it pulled in."""
    loaded = _modules_after(_PARSER_AND_LIST_HEAVY.format(extra="import mtplx.forge.run\n"))
    assert {"mlx.core", "mlx_lm", "mtplx.forge.run"} <= set(loaded)


def test_seed_api_works_verbatim() -> None:
    """The seed's public sampling API, spelled exactly as it was."""
    from mtplx.sampling import (
        SamplerConfig,
        acceptance_probability,
        distribution_from_logits,
        residual_distribution,
        speculative_output_marginal,
    )

    cfg = SamplerConfig(temperature=1.0)
    p = distribution_from_logits(np.log(np.array([0.5, 0.25, 0.25])), cfg)
    q = distribution_from_logits(np.log(np.array([0.25, 0.25, 0.5])), cfg)
    np.testing.assert_allclose(p, [0.5, 0.25, 0.25])
    np.testing.assert_allclose(acceptance_probability(p, q), [1.0, 1.0, 0.5])
    np.testing.assert_allclose(residual_distribution(p, q), [1.0, 0.0, 0.0])
    np.testing.assert_allclose(speculative_output_marginal(p, q), p)
    assert mtplx.SamplerConfig is SamplerConfig


# ------------------------------------------------------------------ layering rules


def imports_into(graph: dict[str, set[str]], source_prefix: str, forbidden: set[str]) -> dict[str, list[str]]:
    """Modules under ``source_prefix`` -> the ``forbidden`` modules they import."""
    return {
        name: sorted(graph[name] & forbidden)
        for name in graph
        if (name == source_prefix or name.startswith(source_prefix + ".")) and graph[name] & forbidden
    }


def head_family_modules(graph: dict[str, set[str]]) -> set[str]:
    return {n for n in graph if n.startswith("mtplx.heads.") and n not in HEAD_INFRASTRUCTURE}


def test_the_engine_imports_no_head_family_module() -> None:
    """The engine reaches heads through discovery and the head protocol, never a family file."""
    graph = import_graph(PACKAGE)
    families = head_family_modules(graph)
    assert {"mtplx.heads.qwen3_next", "mtplx.heads.gemma4_assistant"} <= families  # the walk saw them
    assert imports_into(graph, "mtplx.engine", families) == {}


def test_family_import_check_catches_an_engine_importing_a_family(tmp_path: Path) -> None:
    """Negative control: an engine module importing a family module inside a function is reported."""
    package = tmp_path / "mtplx"
    (package / "engine").mkdir(parents=True)
    (package / "heads").mkdir()
    for init in ("__init__.py", "engine/__init__.py", "heads/__init__.py", "heads/base.py", "heads/mimo.py"):
        (package / init).write_text("")
    (package / "engine" / "engine.py").write_text("def f():\n    from mtplx.heads import mimo\n")
    graph = import_graph(package)
    assert imports_into(graph, "mtplx.engine", head_family_modules(graph)) == {
        "mtplx.engine.engine": ["mtplx.heads.mimo"]
    }


# The ground floor for model files (safetensors headers, fingerprints, hub ids) and what it may read.
GROUND_FLOOR = "mtplx.model_files"
GROUND_FLOOR_READS = {"mtplx", "mtplx.errors"}


def ground_floor_violations(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Upward imports around the ground floor: its modules reading anything of mtplx but
    ``GROUND_FLOOR_READS``, and the trunk / heads / engine reading the checkpoint tools'
    package for what the ground floor holds (``mtplx.checkpoints`` minus ``load``, which the
    heads' discovery and the engine call to load a model)."""
    inside = {n for n in graph if n == GROUND_FLOOR or n.startswith(GROUND_FLOOR + ".")}
    found = {n: sorted(graph[n] - inside - GROUND_FLOOR_READS) for n in inside}
    tools = {n for n in graph if n.startswith("mtplx.checkpoints.") and n != "mtplx.checkpoints.load"}
    for lower in ("mtplx.trunk", "mtplx.heads", "mtplx.engine"):
        found.update(imports_into(graph, lower, tools))
    return {n: bad for n, bad in found.items() if bad}


def test_nothing_imports_upward_around_the_model_files_floor() -> None:
    graph = import_graph(PACKAGE)
    assert {"mtplx.model_files.headers", "mtplx.model_files.hub"} <= set(graph)  # the walk saw them
    assert ground_floor_violations(graph) == {}


def test_ground_floor_check_catches_upward_imports(tmp_path: Path) -> None:
    """Negative control: the floor reading the trunk, and the trunk reading a checkpoint tool, are reported."""
    package = tmp_path / "mtplx"
    for folder in ("model_files", "trunk", "checkpoints"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "errors.py").write_text("")
    (package / "checkpoints" / "gguf.py").write_text("")
    (package / "model_files" / "headers.py").write_text(
        "from mtplx import errors\nfrom mtplx.trunk import x\n"
    )
    (package / "trunk" / "x.py").write_text("def f():\n    from mtplx.checkpoints import gguf\n")
    assert ground_floor_violations(import_graph(package)) == {
        "mtplx.model_files.headers": ["mtplx.trunk", "mtplx.trunk.x"],
        "mtplx.trunk.x": ["mtplx.checkpoints.gguf"],
    }


_PARSER_CALLS = (
    "add_argument",
    "add_parser",
    "add_subparsers",
    "add_mutually_exclusive_group",
    "add_argument_group",
)


def argparse_users(package_dir: Path) -> list[str]:
    """Modules outside the CLI package that import argparse or declare flags (anywhere in the file)."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        if path.relative_to(package_dir).parts[0] == "cli":
            continue
        for node in nodes(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                names = ["argparse"] if node.func.attr in _PARSER_CALLS else []
            if any(n == "argparse" or n.startswith("argparse.") for n in names):
                found.append(str(path.relative_to(package_dir)))
                break
    return found


def test_library_modules_outside_the_cli_use_no_argparse() -> None:
    assert (PACKAGE / "cli" / "args.py").is_file()
    assert argparse_users(PACKAGE) == []


def test_argparse_check_catches_a_library_module(tmp_path: Path) -> None:
    """Negative control: argparse in a library module is reported, in the CLI package it is not."""
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "main.py").write_text("import argparse\n")
    (tmp_path / "bench.py").write_text("def f():\n    from argparse import Namespace\n")
    (tmp_path / "tune.py").write_text("def add_args(parser):\n    parser.add_argument('--depths')\n")
    assert argparse_users(tmp_path) == ["bench.py", "tune.py"]


def long_modules(package_dir: Path, limit: int = MAX_MODULE_LINES) -> dict[str, int]:
    """Modules over ``limit`` lines (docstrings, comments and blank lines count)."""
    counts = {
        str(p.relative_to(package_dir)): len(p.read_text().splitlines()) for p in package_dir.rglob("*.py")
    }
    return {name: n for name, n in counts.items() if n > limit}


def test_no_module_over_600_lines() -> None:
    assert long_modules(PACKAGE) == {}


def test_line_limit_check_catches_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (tmp_path / "long.py").write_text("# why\n" * (MAX_MODULE_LINES + 1))
    assert long_modules(tmp_path) == {"long.py": MAX_MODULE_LINES + 1}


def verify_callers(package_dir: Path) -> list[str]:
    """Modules of ``spec_decode/`` that call a verify (the cycle's verify step: a target sampler's
    `TargetSampler.verify`, or `rejection.verify` itself)."""
    callers = []
    for path in sorted((package_dir / "spec_decode").glob("*.py")):
        for node in nodes(path):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "verify"
            ):
                callers.append(path.name)
                break
    return callers


def test_one_module_of_spec_decode_runs_the_cycle() -> None:
    """The draft -> forward -> verify -> commit cycle exists once (`spec_decode/loop.py`, its
    verify stage `spec_decode/verify_stage.py`): no second module verifies, and the modules it
    replaced are gone."""
    assert verify_callers(PACKAGE) == ["verify_stage.py"]
    gone = ["spec_decode/batch.py", "spec_decode/batch_head.py", "engine/batch.py"]
    assert [name for name in gone if (PACKAGE / name).exists()] == []


def test_the_cycle_check_sees_a_second_verifier(tmp_path: Path) -> None:
    (tmp_path / "spec_decode").mkdir()
    (tmp_path / "spec_decode" / "batch.py").write_text("def f():\n    rejection.verify(1)\n")
    (tmp_path / "spec_decode" / "loop.py").write_text("def g():\n    return rejection.verify(2)\n")
    (tmp_path / "spec_decode" / "proposer.py").write_text("def h(sampler):\n    return sampler.verify(3)\n")
    (tmp_path / "spec_decode" / "step.py").write_text("def i(sampler):\n    return sampler.draft(4)\n")
    assert verify_callers(tmp_path) == ["batch.py", "loop.py", "proposer.py"]


def decoder_users(package_dir: Path) -> list[str]:
    """Modules outside ``spec_decode/`` that name `BatchDecoder` (the one cycle's driver): only the
    one scheduler may, so every entry (stream, batch, server, forge) decodes through it."""
    users = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if relative.parts[0] == "spec_decode":
            continue
        names = {n.id for n in nodes(path) if isinstance(n, ast.Name)}
        names |= {n.attr for n in nodes(path) if isinstance(n, ast.Attribute)}
        names |= {a.name for n in nodes(path) if isinstance(n, ast.ImportFrom) for a in n.names}
        if "BatchDecoder" in names:
            users.append(str(relative))
    return users


def test_only_the_one_scheduler_drives_the_cycle() -> None:
    assert decoder_users(PACKAGE) == ["engine/scheduler.py"]


def test_the_scheduler_check_sees_a_second_driver(tmp_path: Path) -> None:
    for name in ("engine", "forge", "spec_decode"):
        (tmp_path / name).mkdir()
    (tmp_path / "engine" / "scheduler.py").write_text("from x import BatchDecoder\n")
    (tmp_path / "forge" / "record.py").write_text("import x\nd = x.BatchDecoder()\n")
    (tmp_path / "spec_decode" / "loop.py").write_text("class BatchDecoder: ...\n")
    assert decoder_users(tmp_path) == ["engine/scheduler.py", "forge/record.py"]


def drive_loops(package_dir: Path) -> list[str]:
    """ "module:function" of every loop (``while`` / ``for``) that calls ``.step()`` (steps a
    scheduler or a decoder until something ends): "submit, step until idle, collect" written
    again. Only `BatchScheduler.drive` may; every entry iterates it."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = str(path.relative_to(package_dir))
        for function in nodes(path):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            loops = [n for n in ast.walk(function) if isinstance(n, (ast.While, ast.For, ast.AsyncFor))]
            if any(_calls_step(loop) for loop in loops):
                found.append(f"{relative}:{function.name}")
    return sorted(set(found))


def _calls_step(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "step" and not n.args
        for n in ast.walk(node)
    )


def test_one_drive_loop() -> None:
    """`Engine.stream` (`stream_of`), `Engine.generate_batch` (`run_to_completion`), forge's
    `generate_batch` and the server worker all iterate `BatchScheduler.drive`."""
    assert drive_loops(PACKAGE) == ["engine/scheduler.py:drive"]


def test_the_drive_loop_check_sees_a_second_loop(tmp_path: Path) -> None:
    for name in ("engine", "forge", "server"):
        (tmp_path / name).mkdir()
    (tmp_path / "engine" / "scheduler.py").write_text(
        "class S:\n    def drive(self):\n        while True:\n            yield from self.step()\n"
        "    def _step(self):\n        return self.decoder.step()\n"
    )
    (tmp_path / "forge" / "record.py").write_text(
        "def generate(s):\n    while not s.idle:\n        for r in s.step():\n            print(r)\n"
    )
    (tmp_path / "server" / "worker.py").write_text(
        "def run(s):\n    for r in s.drive():\n        print(r)\n    s.step(1)\n"
    )
    assert drive_loops(tmp_path) == ["engine/scheduler.py:drive", "forge/record.py:generate"]


# The logit pipeline's stages: only `mtplx.sample` composes them (`sample/target.TargetSampler`).
PIPELINE_STAGES = {"constrain_logits", "penalize_logits", "mask_logits", "sample", "verify"}
PIPELINE_MODULES = {"mtplx.sample.ops", "mtplx.sample.rejection"}


def pipeline_composers(package_dir: Path) -> list[str]:
    """Modules outside ``sample/`` that call a stage of the logit pipeline themselves (a penalty,
    the grammar mask, a draw or the rejection step of `sample.ops` / `sample.rejection`) instead
    of a `TargetSampler`: "constrain, then sample or verify" composed again at a call site."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir)
        if relative.parts[0] == "sample":
            continue
        aliases, stages = set(), set()
        for node in nodes(path):
            if isinstance(node, ast.ImportFrom) and node.module == "mtplx.sample":
                aliases |= {a.asname or a.name for a in node.names if a.name in ("ops", "rejection")}
            elif isinstance(node, ast.ImportFrom) and node.module in PIPELINE_MODULES:
                stages |= {a.asname or a.name for a in node.names if a.name in PIPELINE_STAGES}
            elif isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name in PIPELINE_MODULES and a.asname}
        for node in nodes(path):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            by_module = (
                isinstance(func, ast.Attribute)
                and func.attr in PIPELINE_STAGES
                and isinstance(func.value, ast.Name)
                and func.value.id in aliases
            )
            if by_module or (isinstance(func, ast.Name) and func.id in stages):
                found.append(str(relative))
                break
    return found


def test_only_the_target_sampler_composes_the_logit_pipeline() -> None:
    """Every call site draws and verifies through `TargetSampler` (first_token, draft, verify):
    none outside ``sample/`` calls the pipeline's stages itself."""
    assert pipeline_composers(PACKAGE) == []


def test_the_pipeline_check_sees_a_hand_composition(tmp_path: Path) -> None:
    for name in ("sample", "spec_decode", "engine"):
        (tmp_path / name).mkdir()
    (tmp_path / "sample" / "target.py").write_text(
        "from mtplx.sample import ops\ndef f(x):\n    return ops.sample(ops.constrain_logits(x))\n"
    )
    (tmp_path / "spec_decode" / "a.py").write_text(
        "from mtplx.sample import ops as sample_ops\ndef g(x):\n    return sample_ops.constrain_logits(x)\n"
    )
    (tmp_path / "spec_decode" / "b.py").write_text(
        "from mtplx.sample.rejection import verify as v\ndef h(x):\n    return v(x)\n"
    )
    (tmp_path / "spec_decode" / "c.py").write_text(
        "from mtplx.sample import ops as sample_ops\ndef i(s, x):\n"
        "    return s.verify(x), sample_ops.draw_uniforms(1)\n"
    )
    (tmp_path / "engine" / "d.py").write_text(
        "import mtplx.sample.rejection as rej\ndef j(x):\n    return rej.verify(x)\n"
    )
    assert pipeline_composers(tmp_path) == ["engine/d.py", "spec_decode/a.py", "spec_decode/b.py"]


MAX_FUNCTION_LINES = 80


def long_functions(package_dir: Path, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions over ``limit`` lines (docstring included) in the packages the one-cycle issue
    holds to it: ``spec_decode/`` and ``engine/``."""
    found = {}
    for sub in ("spec_decode", "engine"):
        for path in sorted((package_dir / sub).glob("*.py")):
            for node in nodes(path):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > limit:
                        found[f"{sub}/{path.name}:{node.name}"] = length
    return found


def test_no_function_over_80_lines_in_the_cycle_and_the_scheduler() -> None:
    assert long_functions(PACKAGE) == {}


def test_function_limit_check_catches_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "spec_decode").mkdir()
    body = "".join("    x = 1\n" for _ in range(MAX_FUNCTION_LINES))
    (tmp_path / "engine" / "a.py").write_text("def short():\n" + body[: -len("    x = 1\n")] + "\n")
    (tmp_path / "spec_decode" / "b.py").write_text("def long():\n" + body)
    assert long_functions(tmp_path) == {"spec_decode/b.py:long": MAX_FUNCTION_LINES + 1}


# ------------------------------------------------------------------ the drafter contract (issue 51)
def drafter_classes(package_dir: Path) -> dict[str, str]:
    """{"module.py:Class": its source} for every class under ``spec_decode/`` with a ``propose``
    method: the drafters (`draft_block.Drafter`). Source: the ``source = Source.X`` class attribute
    ("" without one)."""
    found = {}
    for path in sorted((package_dir / "spec_decode").glob("*.py")):
        for node in nodes(path):
            if not isinstance(node, ast.ClassDef) or "Protocol" in {ast.unparse(b) for b in node.bases}:
                continue
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if "propose" not in methods:
                continue
            source = ""
            for item in node.body:
                if isinstance(item, ast.Assign) and [ast.unparse(t) for t in item.targets] == ["source"]:
                    source = ast.unparse(item.value)
            found[f"{path.name}:{node.name}"] = source
    return found


def block_importers(package_dir: Path) -> list[str]:
    """Drafter modules (`drafter_classes`) that import the cycle's own data (`spec_decode.block`)
    or the loop: drafters return data and the loop merges it; none writes into the cycle's block."""
    drafters = {name.split(":")[0] for name in drafter_classes(package_dir)}
    graph = import_graph(package_dir)
    root = package_dir.name
    cycle_modules = {f"{root}.spec_decode.block", f"{root}.spec_decode.loop"}
    return sorted(m for m in drafters if graph[f"{root}.spec_decode.{m[:-3]}"] & cycle_modules)


def test_drafters_return_data_and_import_no_cycle_module() -> None:
    classes = drafter_classes(PACKAGE)
    assert classes == {
        "block_proposer.py:BlockProposer": "",  # the loaded drafter's (`sources.BLOCK_SOURCES`)
        "constraint.py:ForcedDrafter": "Source.GRAMMAR",
        "draft_model_proposer.py:ModelDrafter": "Source.MODEL",
        "eagle3_proposer.py:Eagle3Proposer": "",  # Source.EAGLE3's (a BlockProposer)
        "head_chain.py:HeadChain": "Source.HEAD",
        "lookup_proposer.py:LookupDrafter": "Source.LOOKUP",
    }
    assert block_importers(PACKAGE) == []


def test_one_head_drafter_class() -> None:
    """One head drafter for one row or many (the single-row `HeadProposer` is gone)."""
    heads = [name for name, source in drafter_classes(PACKAGE).items() if source == "Source.HEAD"]
    assert heads == ["head_chain.py:HeadChain"]
    assert not (PACKAGE / "spec_decode" / "head_proposer.py").exists()
    assert not (PACKAGE / "spec_decode" / "auto_proposer.py").exists()


def test_the_drafter_checks_see_a_block_import_and_a_second_head_drafter(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "spec_decode").mkdir(parents=True)
    for name in ("__init__.py", "spec_decode/__init__.py", "spec_decode/block.py"):
        (package / name).write_text("")
    (package / "spec_decode" / "head_chain.py").write_text(
        "class HeadChain:\n    source = Source.HEAD\n    def propose(self): ...\n"
    )
    (package / "spec_decode" / "single.py").write_text(
        "from pkg.spec_decode.block import Block\n\n"
        "class HeadProposer:\n    source = Source.HEAD\n    def propose(self): ...\n"
    )
    assert block_importers(package) == ["single.py"]
    heads = [name for name, source in drafter_classes(package).items() if source == "Source.HEAD"]
    assert heads == ["head_chain.py:HeadChain", "single.py:HeadProposer"]


# The drafter names of the request and the cycle: compared only in spec_decode/drafting.py.
DRAFTER_NAMES = {"auto", "head", "lookup", "model", "none", "proposer", "grammar"}


def drafter_name_comparisons(package_dir: Path) -> list[str]:
    """ "module:line" of every comparison of a drafter's name as a string (``kind == "head"``,
    ``draft in ("lookup", "auto")``) outside ``spec_decode/drafting.py``: a comparison whose one
    side is such a string (or a tuple of them) and whose other side names a drafter (an
    expression mentioning draft, kind or source; not draft_vocab / draft_policy, other settings)."""
    import re

    drafter_ish = re.compile(r"draft(?!_vocab|_policy)|kind|source")
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = str(path.relative_to(package_dir))
        if relative == "spec_decode/drafting.py":
            continue
        for node in nodes(path):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            names = [s for s in sides if _is_drafter_name(s)]
            others = [ast.unparse(s) for s in sides if not _is_drafter_name(s)]
            if names and any(drafter_ish.search(o) for o in others):
                found.append(f"{relative}:{node.lineno}")
    return found


def _is_drafter_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in DRAFTER_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in DRAFTER_NAMES for e in node.elts)
    return False


def test_no_module_outside_drafting_compares_a_drafter_name() -> None:
    assert drafter_name_comparisons(PACKAGE) == []


def test_the_drafter_name_check_sees_a_string_comparison(tmp_path: Path) -> None:
    (tmp_path / "spec_decode").mkdir()
    (tmp_path / "spec_decode" / "drafting.py").write_text("ok = kind == 'head'\n")
    (tmp_path / "loop.py").write_text(
        "a = row.spec.drafter == 'head'\n"
        "b = kind in ('lookup', 'auto')\n"
        "c = kind is DrafterKind.HEAD\n"
        "d = state == 'head'\n"
        "e = cfg.draft_vocab == 'auto'\n"
    )
    assert drafter_name_comparisons(tmp_path) == ["loop.py:1", "loop.py:2"]
