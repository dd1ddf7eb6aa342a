"""The layers' imports point down (LAYERS and MAY_IMPORT below; docs/architecture.md draws them).

Every import in the installed package (module level or inside a function: a lazy import is still a
dependency) is checked against what its layer may import, and the hook IR loads without vLLM."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the folders of the installed package (pyproject's package-dir)
FOLDERS = {"xmix_lens": ROOT / "xmix_lens", "xmix_lens.backend": ROOT / "backend", "xmix_lens.kernels": ROOT / "kernels"}

# Each layer, by the modules in it (a name stands for itself and the modules below it).
LAYERS = {
    "vocabulary": ["xmix_lens.ops", "xmix_lens.functional", "xmix_lens.hook_points"],
    "ir": ["xmix_lens.ir"],
    "trace": ["xmix_lens.trace", "xmix_lens.stores"],
    "lower": ["xmix_lens.lower", "xmix_lens.lowered", "xmix_lens.passes", "xmix_lens.app_config",
              "xmix_lens.request_choice"],
    "kernels": ["xmix_lens.kernels"],
    "backend": ["xmix_lens.backend"],
    "api": ["xmix_lens"],  # the rest of the package: model, app, cache, apps, cli, model_files
}
# What each layer may import from the package. Kernels know tensors, launch arguments and the op
# table, not the IR classes; the backend runs lowered ops, never traces.
MAY_IMPORT = {
    "vocabulary": {"vocabulary"},
    "ir": {"vocabulary", "ir"},
    "trace": {"vocabulary", "ir", "trace"},
    "lower": {"vocabulary", "ir", "trace", "lower"},
    "kernels": {"vocabulary", "kernels"},
    "backend": {"vocabulary", "lower", "kernels", "backend"},
    "api": set(LAYERS),
}
ONLY_IN_BACKEND = ("vllm",)  # third-party packages only the backend may import


def layer_of(module: str) -> str:
    matches = [(len(prefix), layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1]


def modules():
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] in FOLDERS and package == "xmix_lens":
                continue  # never: backend/ and kernels/ are separate folders
            name = ".".join((package, *parts)).removesuffix(".__init__")
            yield name, path, path.name == "__init__.py"


def imports(module: str, path: Path, is_package: bool):
    """Absolute names of everything a module imports."""
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
            yield from (f"{base}.{a.name}" if f"{base}.{a.name}" in KNOWN else base for a in node.names)


ALL = sorted(modules())
KNOWN = {m for m, _, _ in ALL}


@pytest.mark.parametrize("module,path,is_package", ALL, ids=[m for m, _, _ in ALL])
def test_imports_point_down(module, path, is_package):
    layer = layer_of(module)
    for name in imports(module, path, is_package):
        top = name.split(".")[0]
        if top == "xmix_lens":
            assert layer_of(name) in MAY_IMPORT[layer], \
                f"{module} ({layer}) imports {name} ({layer_of(name)}): a lower layer never imports a higher one"
        elif top in ONLY_IN_BACKEND:
            assert layer == "backend", f"{module} ({layer}) imports {name}: only the backend talks to vLLM"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "ir.py"
    bad.write_text("def f():\n    from .backend.vllm.sites import site_table\n")
    found = list(imports("xmix_lens.ir", bad, False))
    assert found == ["xmix_lens.backend.vllm.sites"]
    assert layer_of(found[0]) not in MAY_IMPORT[layer_of("xmix_lens.ir")]


def test_the_hook_ir_loads_without_vllm():
    """`import xmix_lens.ir` (and trace, lower) loads no vLLM, no backend and no model code."""
    code = ("import sys, xmix_lens.ir, xmix_lens.trace, xmix_lens.lower; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'triton', 'transformers') "
            "or m.startswith(('xmix_lens.backend', 'xmix_lens.model', 'xmix_lens.kernels'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert loaded.stdout.strip() == "[]", loaded.stdout
