"""The package's shape, as docs/architecture.md describes it: no import cycles between its modules
(counting imports inside functions and under ``TYPE_CHECKING``), no module reaching into another
object's private state, no function over 60 lines."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "grpo_lab"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imported(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The grpo_lab modules ``name`` imports anywhere: at import time, inside functions and under
    ``if TYPE_CHECKING`` (an import that runs later still ties the two modules, and a reader follows it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _imported(node, package)
            found.update(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                         for alias in node.names)
    return {module for module in found if module in modules and module != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return cycles


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "grpo_lab.config.fields" in graph["grpo_lab.config.grpo_config"]
    assert "grpo_lab.views.dashboard" in graph["grpo_lab.session.session"]  # an import inside a method counts
    assert _cycles(graph) == []


def test_functions_stay_small():
    too_long = [
        f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for name, path in _modules().items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60
    ]
    assert too_long == []


PRIVATE_REACH_ALLOWED = {
    # torch's and transformers' own state, read where they offer no public way
    ("accel/compact_forward.py", "module._forward_hooks"): "a module with hooks is run by its forward, not bypassed",
    ("accel/compact_forward.py", "module._forward_pre_hooks"): "as _forward_hooks",
    ("accel/prefix_sharing.py", "module._modules"): "torch's child modules by name, to find the decoder layers",
    ("rewards/preparation.py", "func.config._name_or_path"): "transformers' record of where a reward model came from",
    ("rollout/hf.py", "model.config._attn_implementation"): "transformers' attention choice, which it sets there",
    # accelerate's process-wide singletons, reset between runs in one process
    ("parallel/dist.py", "PartialState._shared_state"): "accelerate's singleton state; no public reset",
    ("parallel/dist.py", "AcceleratorState._shared_state"): "as PartialState._shared_state",
    ("parallel/dist.py", "AcceleratorState._reset_state"): "accelerate's reset, the one it uses in its own tests",
    # DeepSpeed's partitioned parameters and optimizer state
    ("parallel/zero.py", "owner._parameters"): "ZeRO-3 replaces parameters in torch's parameter table",
    ("parallel/zero.py", "zero._hp_optimizer_states_linked"): "DeepSpeed's flag for linked optimizer state",
    ("parallel/zero.py", "zero._lazy_init_hp_params_optimizer_state"):
        "DeepSpeed's lazy set-up, run before reading the state",
    # the standard library and Python's protocols
    ("notices.py", "sys._getframe"): "the caller's frame, for the warning's location",
    ("rewards/code_sandbox_child.py", "sys.modules['subprocess']._fork_exec"): "closes the sandbox's way to fork",
    ("rewards/code_sandbox_child.py", "os._exit"): "ends the sandbox child without running the user's atexit code",
    ("views/batch.py", "trained._replace"): "a NamedTuple's public copy-with method",
    ("views/findings.py", "findings._repr_html_"): "IPython's display protocol",
    ("errors.py", "shell._showtraceback"): "IPython's way for a custom exception handler to show its lines",
    # a marker grpo_lab sets on a transformers module it casts
    ("core/models.py", "embeddings._grpo_lab_output_dtype"): "grpo_lab's own marker on a module it changed",
    ("core/models.py", "module._grpo_lab_output_dtype"): "as embeddings._grpo_lab_output_dtype",
}
"""The only places a grpo_lab module reads or writes an underscore attribute of an object other than
``self`` or ``cls``, each with its reason: none of them is grpo_lab's own state."""


def _private_reach() -> set[tuple[str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                found.add((path.relative_to(PACKAGE).as_posix(), ast.unparse(node)))
    return found


def test_no_module_reaches_into_another_objects_private_state():
    """A part's state is its own: others use its methods and public attributes (docs/architecture.md)."""
    found = _private_reach()
    assert found - PRIVATE_REACH_ALLOWED.keys() == set(), "use the owner's public interface"
    assert PRIVATE_REACH_ALLOWED.keys() - found == set(), "an allowed place is gone: drop it from the list"


def test_the_paths_from_before_the_folders_keep_working():
    import subprocess
    import sys

    # in a fresh interpreter: the lazy package attributes must work without the modules loaded first
    code = """
import grpo_lab, grpo_lab.config, grpo_lab.session, grpo_lab.trainer, grpo_lab.state, grpo_lab.cli
from grpo_lab.config import GRPOConfig
from grpo_lab.session import GRPOSession
from grpo_lab.trainer import GRPOTrainer
from grpo_lab.state import FORMAT_VERSION
from grpo_lab.cli import main
import grpo_lab.live_config, grpo_lab.what_if, grpo_lab.ownership
from grpo_lab.config import live
from grpo_lab.session import ownership, what_if
from grpo_lab.state import run_state
from grpo_lab.cli import commands
assert (GRPOConfig, GRPOSession, GRPOTrainer) == (grpo_lab.GRPOConfig, grpo_lab.GRPOSession, grpo_lab.GRPOTrainer)
assert FORMAT_VERSION == run_state.FORMAT_VERSION and main is commands.main
assert (grpo_lab.live_config, grpo_lab.what_if, grpo_lab.ownership) == (live, what_if, ownership)
assert grpo_lab.live_config.CHANGE_KINDS is live.CHANGE_KINDS
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    subprocess.run([sys.executable, "-m", "grpo_lab.cli", "--version"], check=True, capture_output=True)
