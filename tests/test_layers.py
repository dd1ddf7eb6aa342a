"""The layers' imports point down and form no cycle (LAYERS and MAY_IMPORT below; docs/architecture.md
draws them).

Every module of the installed package is named in one layer, and every import in it (module level
or inside a function: a lazy import is still a dependency) is checked against what its layer may
import; the imports form no cycle; and the hook IR loads without vLLM."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folders of the installed package (pyproject's package-dir)
FOLDERS = {"xmix_lens": ROOT / "xmix_lens", "xmix_lens.backend": ROOT / "backend", "xmix_lens.kernels": ROOT / "kernels"}

# Each layer, by the modules in it. "pkg.*" names a subpackage as a whole: pkg and every module
# below it. Names of modules not written yet are allowed: only the package's modules are checked.
LAYERS = {
    "vocabulary": ["xmix_lens.ops", "xmix_lens.functional", "xmix_lens.hook_points", "xmix_lens.families"],
    "ir": ["xmix_lens.ir"],
    "trace": ["xmix_lens.trace", "xmix_lens.stores"],
    "lower": ["xmix_lens.lower", "xmix_lens.lowered", "xmix_lens.passes"],
    # the app-config and request-choice formats: the API writes them, the backend reads them
    "formats": ["xmix_lens.app_config", "xmix_lens.request_choice"],
    "kernels": ["xmix_lens.kernels.*"],
    # the engine contract: what the API asks of an engine, in passes
    "engine": ["xmix_lens.backend.engine"],
    # the engine-neutral backend: lowered ops run, the control plane, tensor parallelism
    "backend": ["xmix_lens.backend", "xmix_lens.backend.executor", "xmix_lens.backend.control",
                "xmix_lens.backend.messenger", "xmix_lens.backend.sharding", "xmix_lens.backend.cudart"],
    "vllm": ["xmix_lens.backend.vllm.*"],
    # a call's hooks traced, lowered and run as passes; apps in and out; the computed hook points
    "planning": ["xmix_lens.planner", "xmix_lens.resident_calls", "xmix_lens.installer", "xmix_lens.app",
                 "xmix_lens.hooked_root", "xmix_lens.computed_points", "xmix_lens.attention_points"],
    # TransformerLens's surface and the user's entry points
    "api": ["xmix_lens", "xmix_lens.model", "xmix_lens.cli", "xmix_lens.evaluation", "xmix_lens.cache",
            "xmix_lens.tl_surface", "xmix_lens.model_files", "xmix_lens.verbosity", "xmix_lens.utils",
            "xmix_lens.apps.*"],
}
# What each layer may import from the package. Kernels know tensors, launch arguments and the op
# table, not the IR classes; the backend runs lowered ops, never traces; the API reaches an engine
# through its contract.
MAY_IMPORT = {
    "vocabulary": {"vocabulary"},
    "ir": {"vocabulary", "ir"},
    "trace": {"vocabulary", "ir", "trace"},
    "lower": {"vocabulary", "ir", "trace", "lower"},
    "formats": {"vocabulary", "ir", "trace", "lower", "formats"},
    "kernels": {"vocabulary", "kernels"},
    "engine": {"vocabulary", "lower", "engine"},
    "backend": {"vocabulary", "lower", "kernels", "engine", "backend"},
    "vllm": {"vocabulary", "lower", "formats", "kernels", "engine", "backend", "vllm"},
    "planning": {"vocabulary", "ir", "trace", "lower", "formats", "engine", "planning"},
    "api": set(LAYERS) - {"backend", "vllm"},
}
# Outside the vLLM engine only these import it: from_pretrained builds it, verbosity sets vLLM's logging.
VLLM_IMPORTERS = {"xmix_lens.model", "xmix_lens.verbosity"}
ONLY_IN_VLLM = ("vllm",)  # third-party packages only the vLLM engine may import


def layers_naming(module: str) -> list[str]:
    def names(entry):
        whole = entry.removesuffix(".*")
        return module == entry or (entry != whole and (module == whole or module.startswith(whole + ".")))

    return [layer for layer, entries in LAYERS.items() for entry in entries if names(entry)]


def layer_of(module: str) -> str | None:
    layers = layers_naming(module)
    return layers[0] if len(layers) == 1 else None


def modules():
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] in FOLDERS and package == "xmix_lens":
                continue  # never: backend/ and kernels/ are separate folders
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield name, path, path.name == "__init__.py"


def imports(module: str, path: Path, is_package: bool, known: set[str] | None = None):
    """Absolute names of everything a module imports (`known`: the modules there are, KNOWN unless given)."""
    known = KNOWN if known is None else known
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import name` may name a submodule: check it as pkg.name when it is one
            yield from (f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)


def import_graph(mods) -> dict[str, set[str]]:
    """Each module of `mods` ((name, path, is_package) triples) -> the modules of `mods` it imports."""
    known = {m for m, _, _ in mods}

    def module_of(name):  # the module an imported name is, or is in (`pkg` for a name pkg's __init__ holds)
        parts = name.split(".")
        return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in known), None)

    return {m: {module_of(n) for n in imports(m, path, is_package, known)} - {None, m}
            for m, path, is_package in mods}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of a graph, each as [a, b, ..., a]: at least one wherever there is one (a depth-first
    search's back edges)."""
    cycles, done, path = [], set(), []

    def visit(node):
        path.append(node)
        for following in sorted(graph.get(node, ())):
            if following in path:
                cycles.append(path[path.index(following):] + [following])
            elif following not in done:
                visit(following)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return cycles


ALL = sorted(modules())
KNOWN = {m for m, _, _ in ALL}


@pytest.mark.parametrize("module", sorted(KNOWN))
def test_every_module_is_in_one_layer(module):
    layers = layers_naming(module)
    assert layers, f"{module} is in no layer: add it to a layer of LAYERS in tests/test_layers.py (and to the " \
                   f"layer table of docs/architecture.md)"
    assert len(layers) == 1, f"{module} is named by layers {layers}: name it in one"


@pytest.mark.parametrize("module,path,is_package", ALL, ids=[m for m, _, _ in ALL])
def test_imports_point_down(module, path, is_package):
    layer = layer_of(module)
    assert layer is not None, f"{module} is not in one layer (test_every_module_is_in_one_layer)"
    may_import = MAY_IMPORT[layer] | ({"vllm"} if module in VLLM_IMPORTERS else set())
    for name in imports(module, path, is_package):
        top = name.split(".")[0]
        if top == "xmix_lens":
            assert layer_of(name) in may_import, \
                f"{module} ({layer}) imports {name} ({layer_of(name)}): a lower layer never imports a higher one"
        elif top in ONLY_IN_VLLM:
            assert layer == "vllm", f"{module} ({layer}) imports {name}: only the vLLM engine talks to vLLM"


def test_only_from_pretrained_and_verbosity_import_the_vllm_engine():
    """The rest of the package reaches an engine through its contract, xmix_lens.backend.engine."""
    importers = {module for module, path, is_package in ALL if layer_of(module) != "vllm"
                 and any(layer_of(name) == "vllm" for name in imports(module, path, is_package))}
    assert importers <= VLLM_IMPORTERS, \
        f"{sorted(importers - VLLM_IMPORTERS)} import xmix_lens.backend.vllm; use xmix_lens.backend.engine"


def test_imports_form_no_cycle():
    cycles = find_cycles(import_graph(ALL))
    assert not cycles, "import cycles (a lazy import counts):\n" + "\n".join(" → ".join(c) for c in cycles)


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "ir.py"
    bad.write_text("def f():\n    from .backend.vllm.sites import site_table\n")
    found = list(imports("xmix_lens.ir", bad, False))
    assert found == ["xmix_lens.backend.vllm.sites"]
    assert layer_of(found[0]) not in MAY_IMPORT[layer_of("xmix_lens.ir")]


def test_the_check_sees_a_cycle(tmp_path):
    """a imports b, b imports c lazily, c imports a: named as a cycle; without c's import, none."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "c.py").write_text("from .a import h\n")
    mods = [("pkg", tmp_path / "__init__.py", True)] + [(f"pkg.{m}", tmp_path / f"{m}.py", False) for m in "abc"]
    assert find_cycles(import_graph(mods)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    (tmp_path / "c.py").write_text("import torch\n")
    assert find_cycles(import_graph(mods)) == []


def test_the_hook_ir_loads_without_vllm():
    """`import xmix_lens.ir` (and trace, lower) loads no vLLM, no backend and no model code."""
    code = ("import sys, xmix_lens.ir, xmix_lens.trace, xmix_lens.lower; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'triton', 'transformers') "
            "or m.startswith(('xmix_lens.backend', 'xmix_lens.model', 'xmix_lens.kernels'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert loaded.stdout.strip() == "[]", loaded.stdout
