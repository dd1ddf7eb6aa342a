"""App configs: installed apps as files, for a server to load (no Python, no pickle).

A config is a folder:

    manifest.json          what the apps are (the schema below, validated with pydantic)
    <app>.safetensors      the tensors of one app's ops, named as the manifest references them

The manifest holds a fingerprint of the model the apps were lowered for and, per app, its lowered
resident ops (xmix_lens.lowered: affine writes, projection reads, per-token programs) in
declarative form, and its reads (which op delivers which of the app's outputs). A config can only
make the engine run the op table's ops with these tensors at these hook points: nothing in it is
executed, and it names no file outside its folder.

`write` makes a folder from lowered apps; `read` loads one and checks everything a served model
needs before anything starts: the schema, the fingerprint, every tensor's presence, dtype and
shape against the hook point it runs at, and that the folder holds nothing else. Errors name the
app, the field and the fix.
"""
import hashlib
import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from .families import ARCHITECTURES
from .hook_points import feature_shape, hook_names, model_dims
from .lowered import (AffineWrite, GeneratedRead, GeneratedWrite, LoweredOp, Read, ResidentRead, TokenOp, TokenProgram,
                      named_tensors)
from .ops import OPS
from .trace import StoreSpec

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fingerprint(_Strict):
    """The model the apps were lowered for: a served model must match every field."""

    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    config_sha256: str  # of the model's config.json: same shapes, other weights' config still differs


Slopes = dict[str, dict[str, str]]  # request param -> {op field: tensor name}: field += (value - default) * slope


class AffineWriteSpec(_Strict):
    kind: Literal["affine_write"]
    scale: str  # tensor names in the app's .safetensors
    bias: str
    U: str
    V: str
    slopes: Slopes = {}  # fields: "bias"


class StorePut(_Strict):
    """A read whose values fold into a prompt-level store of the app instead of going home."""

    name: str
    reduce: Literal["mean", "sum"]


class ReadSpec(_Strict):
    kind: Literal["read"]
    key: tuple[str, str, int] | tuple[Literal["store"], str]  # (phase, hook point, index), or a put's ("store", name)
    W: str | None
    bias: str | None
    feature_shape: list[int]
    store: StorePut | None = None


class TokenOpSpec(_Strict):
    op: Literal[tuple(OPS)]  # type: ignore[valid-type]  (an op of the op table, xmix_lens.ops)
    args: list[StrictInt | StrictFloat | None]  # ints: earlier ops or consts; floats: numbers
    shape: list[int]


class ProgramSpec(_Strict):
    ops: list[TokenOpSpec]
    consts: list[str]
    output: int


class GeneratedWriteSpec(_Strict):
    kind: Literal["generated_write"]
    program: ProgramSpec
    slopes: Slopes = {}  # fields: "consts[i]"
    store_tables: dict[int, str] = {}  # const index -> the store whose per-request values it reads


class GeneratedReadSpec(_Strict):
    kind: Literal["generated_read"]
    key: tuple[str, str, int] | tuple[Literal["store"], str]
    program: ProgramSpec
    feature_shape: list[int]
    slopes: Slopes = {}
    store: StorePut | None = None
    store_tables: dict[int, str] = {}


OpSpec = Annotated[Union[AffineWriteSpec, ReadSpec, GeneratedWriteSpec, GeneratedReadSpec], Field(discriminator="kind")]


class ReadOutput(_Strict):
    """Which of the app's outputs (`app.outputs[output]`) a read delivers, per token (with `last`,
    each request's last position: the hook read `act[:, -1]`)."""

    key: tuple[str, str, int]
    output: str
    feature_shape: list[int]
    last: bool = False


class RequestParam(_Strict):
    """A scalar parameter a request may set (`vllm_xargs["xmix.<app>.<name>"]`), within bounds."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$")
    default: float
    minimum: float
    maximum: float


class AppSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")  # no ".": a request names `xmix.<app>.<param>`
    version: int
    description: str = ""
    ops: dict[str, list[OpSpec]]  # hook point -> its ops, in order
    reads: list[ReadOutput]
    params: list[RequestParam] = []


def reads_of(spec: AppSpec) -> dict[tuple, ResidentRead]:
    """An app's reads by read key, as the model and the server deliver them."""
    return {tuple(r.key): ResidentRead(r.output, tuple(r.feature_shape), r.last) for r in spec.reads}


def declared(spec: AppSpec) -> dict[str, tuple[float, float, float]]:
    """An app's request params: {name: (default, lowest, highest)}."""
    return {p.name: (p.default, p.minimum, p.maximum) for p in spec.params}


class Manifest(_Strict):
    schema_version: Literal[SCHEMA_VERSION]
    model: Fingerprint
    apps: list[AppSpec]
    # the model's dtype when the apps were exported (their reads were checked in it): what
    # `xmix-lens serve` serves in unless told otherwise
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class ConfigError(ValueError):
    """A config that cannot be served; the message names the app, the field and the fix."""


def exported_dtype(folder: Path) -> str:
    """The dtype a config's apps were exported at (its manifest's `dtype`)."""
    try:
        return Manifest.model_validate_json((Path(folder) / MANIFEST).read_text()).dtype
    except (OSError, ValidationError) as e:
        raise ConfigError(f"{folder} is not a readable xmix-lens app config ({e}); make one with xmix-lens export") \
            from None


def fingerprint(model_dir: Path) -> Fingerprint:
    """The fingerprint of a Hugging Face model folder (from its config.json alone)."""
    raw = (Path(model_dir) / "config.json").read_bytes()
    hf = json.loads(raw)
    arch = (hf.get("architectures") or ["?"])[0]
    dims = model_dims(SimpleNamespace(**hf))
    return Fingerprint(architecture=arch, n_layers=hf.get("num_hidden_layers", hf.get("n_layer")),
                       d_model=dims["d_model"], n_heads=dims["n_heads"], n_kv_heads=dims["n_kv_heads"],
                       d_head=dims["d_head"], d_mlp=dims["d_mlp"], d_vocab=hf["vocab_size"],
                       config_sha256=hashlib.sha256(raw).hexdigest())


# --- writing ------------------------------------------------------------------------------------
def write(folder: Path, model_dir: Path, apps: list[tuple[str, int, str, dict, dict, list]],
          dtype: torch.dtype = torch.float32) -> Path:
    """Write a config for `apps`: (name, version, description, ops by hook point, reads {key:
    ResidentRead}, request params [(name, default, lowest, highest)]), lowered for the
    model in `model_dir` (ops carry their params' slopes). The folder must not exist or be empty."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty; export into a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    specs = []
    for name, version, description, ops, reads, params in apps:
        tensors: dict[str, torch.Tensor] = {}
        op_specs = {point: [_op_spec(op, tensors, f"{point}.{i}") for i, op in enumerate(point_ops)]
                    for point, point_ops in ops.items()}
        specs.append(AppSpec(name=name, version=version, description=description, ops=op_specs,
                             reads=[ReadOutput(key=key, output=read.output, feature_shape=list(read.feature_shape),
                                               last=read.last) for key, read in reads.items()],
                             params=[RequestParam(name=n, default=d, minimum=lo, maximum=hi)
                                     for n, d, lo, hi in params]))
        # each tensor its own storage: ops may share one (an SAE's encoder feeds its read and its clamp),
        # which safetensors refuses to write
        save_file({k: t.detach().cpu().clone() for k, t in tensors.items()}, folder / f"{name}.safetensors")
    manifest = Manifest(schema_version=SCHEMA_VERSION, model=fingerprint(model_dir), apps=specs,
                        dtype=str(dtype).removeprefix("torch."))
    (folder / MANIFEST).write_text(manifest.model_dump_json(indent=1))
    return folder


def _op_spec(op: LoweredOp, tensors: dict, prefix: str):
    def ref(name, t):
        if t is None:
            return None
        tensors[f"{prefix}.{name}"] = t
        return f"{prefix}.{name}"

    if op.positions is not None:
        raise ValueError("an op that selects positions is not resident")  # export checked before
    slopes = {param: {field: ref(f"slope.{param}.{field}", t) for field, t in by_field.items()}
              for param, by_field in getattr(op, "slopes", {}).items()}
    store = getattr(op, "store", None)
    store = StorePut(name=store.name, reduce=store.reduce) if store is not None else None
    if not op.is_program:  # a parametric template
        if op.writes:
            return AffineWriteSpec(kind="affine_write", scale=ref("scale", op.scale), bias=ref("bias", op.bias),
                                   U=ref("U", op.U), V=ref("V", op.V), slopes=slopes)
        return ReadSpec(kind="read", key=op.key, W=ref("W", op.W), bias=ref("bias", op.bias),
                        feature_shape=list(op.feature_shape), store=store)
    tables = op.store_tables  # a store's table is the engine's: its shape, not its values, is written
    program = ProgramSpec(ops=[TokenOpSpec(op=o.op, args=list(o.args), shape=list(o.shape)) for o in op.program.ops],
                          consts=[ref(f"const{i}", c[:1] if i in tables else c) for i, c in enumerate(op.program.consts)],
                          output=op.program.output)
    if op.writes:
        return GeneratedWriteSpec(kind="generated_write", program=program, slopes=slopes, store_tables=tables)
    return GeneratedReadSpec(kind="generated_read", key=op.key, program=program, feature_shape=list(op.feature_shape),
                             slopes=slopes, store=store, store_tables=tables)


# --- reading ------------------------------------------------------------------------------------
def read(folder: Path, model_dir: Path) -> list[tuple[AppSpec, dict[str, list[LoweredOp]]]]:
    """Load and check a config for the model in `model_dir`: per app, its spec and its ops by hook point."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise ConfigError(f"{folder} has no {MANIFEST}: it is not an xmix-lens app config; make one with "
                          f"xmix_lens.export(apps, folder, model=...)")
    try:
        manifest = Manifest.model_validate_json((folder / MANIFEST).read_text())
    except ValidationError as e:
        raise ConfigError(f"{folder / MANIFEST} does not match the app-config schema (version {SCHEMA_VERSION}):\n"
                          f"{_where(e)}\nexport the apps again with this version of xmix-lens") from None
    served = fingerprint(model_dir)
    for field, want in manifest.model:
        if getattr(served, field) != want:
            raise ConfigError(f"{folder}: the apps were exported for another model: model.{field} is {want!r} in the "
                              f"config, {getattr(served, field)!r} for {model_dir}; export them again on this model")
    expected = {f"{a.name}.safetensors" for a in manifest.apps} | {MANIFEST}
    for p in sorted(folder.iterdir()):
        if p.name not in expected:
            raise ConfigError(f"{folder}: {p.name} is not part of the config (a config holds {MANIFEST} and one "
                              f".safetensors file per app, nothing else: no pickles, no code); remove it")
    if len({a.name for a in manifest.apps}) != len(manifest.apps):
        raise ConfigError(f"{folder}: two apps have the same name; app names are unique")
    if served.architecture not in ARCHITECTURES:
        raise ConfigError(f"{folder}: architecture {served.architecture} is not supported; supported: "
                          f"{sorted(ARCHITECTURES)}")
    family = ARCHITECTURES[served.architecture].name
    points, hf = set(hook_names(family, served.n_layers)), json.loads((Path(model_dir) / "config.json").read_text())
    loaded = []
    for app in manifest.apps:
        path = folder / f"{app.name}.safetensors"
        if not path.is_file():
            raise ConfigError(f"app {app.name!r}: {path.name} is missing from {folder}; export the app again")
        with safe_open(path, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        ops = {}
        for point, specs in app.ops.items():
            if point not in points:
                raise ConfigError(f"app {app.name!r}: ops.{point}: not a hook point the engine places for {family} "
                                  f"models; export the app again")
            F = math.prod(feature_shape(point, SimpleNamespace(**hf)))
            ops[point] = [_with_slopes(app, f"ops.{point}[{i}]", spec, _op(app.name, f"ops.{point}[{i}]", spec, tensors,
                                                                         F), tensors) for i, spec in enumerate(specs)]
        keys = {op.key for point_ops in ops.values() for op in point_ops if hasattr(op, "key")}
        for r in app.reads:
            if r.key not in keys:
                raise ConfigError(f"app {app.name!r}: reads names key {list(r.key)}, which no read op has")
        loaded.append((app, ops))
    return loaded


def _op(app: str, where: str, spec, tensors: dict, F: int) -> LoweredOp:
    def get(name: str | None, field: str, shape: tuple | None = None) -> torch.Tensor | None:
        if name is None:
            return None
        if name not in tensors:
            raise ConfigError(f"app {app!r}: {where}.{field} names tensor {name!r}, which is not in "
                              f"{app}.safetensors; export the app again")
        t = tensors[name]
        if not t.is_floating_point():
            raise ConfigError(f"app {app!r}: {where}.{field} ({name}) is {t.dtype}; op tensors are floating point")
        if shape is not None and any(want is not None and want != got for want, got in zip(shape, t.shape)) \
                or shape is not None and len(shape) != t.dim():
            raise ConfigError(f"app {app!r}: {where}.{field} ({name}) has shape {list(t.shape)}, the hook point needs "
                              f"{[s if s is not None else '*' for s in shape]} ({F} features per token); export the "
                              f"app again on this model")
        return t

    if isinstance(spec, AffineWriteSpec):
        K = tensors[spec.U].shape[-1] if spec.U in tensors else None  # the low rank: U's to decide
        return AffineWrite(None, get(spec.scale, "scale", (F,)), get(spec.bias, "bias", (F,)),
                           get(spec.U, "U", (F, K)), get(spec.V, "V", (K, F)))
    store = StoreSpec(spec.store.name, spec.store.reduce, tuple(spec.feature_shape)) \
        if getattr(spec, "store", None) is not None else None
    if isinstance(spec, ReadSpec):
        O = math.prod(spec.feature_shape)
        return Read(spec.key, None, True, get(spec.W, "W", (F, O)), get(spec.bias, "bias", (O,)),
                    tuple(spec.feature_shape), store)
    program = _program(app, where, spec.program, get)
    if any(i >= len(program.consts) for i in spec.store_tables):
        raise ConfigError(f"app {app!r}: {where}.store_tables names a const the program does not have; export the "
                          f"app again")
    if isinstance(spec, GeneratedWriteSpec):
        return GeneratedWrite(None, program, store_tables=dict(spec.store_tables))
    return GeneratedRead(spec.key, None, True, program, tuple(spec.feature_shape), store,
                         store_tables=dict(spec.store_tables))


def _with_slopes(app: AppSpec, where: str, spec, op: LoweredOp, tensors: dict) -> LoweredOp:
    """The op with its request params' slopes: each names a declared param and a field a request's
    value can change (a write's bias, a program's consts), with a tensor of that field's shape."""
    declared = {p.name for p in app.params}
    named = dict(named_tensors(op))
    for param, by_field in getattr(spec, "slopes", {}).items():  # a read has none
        if param not in declared:
            raise ConfigError(f"app {app.name!r}: {where}.slopes names {param!r}, which params does not declare; "
                              f"export the app again")
        for field, name in by_field.items():
            if not op.may_take_slope(field) or field not in named:
                raise ConfigError(f"app {app.name!r}: {where}.slopes.{param}.{field}: a request's value can change a "
                                  f"write's bias or a program's consts, not {field}; export the app again")
            slope = tensors.get(name)
            if slope is None or slope.shape != named[field].shape or not slope.is_floating_point():
                raise ConfigError(f"app {app.name!r}: {where}.slopes.{param}.{field} ({name}) is missing or not a "
                                  f"float tensor of shape {list(named[field].shape)}; export the app again")
            op.slopes.setdefault(param, {})[field] = slope
    return op


def _program(app: str, where: str, spec: ProgramSpec, get) -> TokenProgram:
    consts = [get(name, f"program.consts[{i}]") for i, name in enumerate(spec.consts)]
    for i, o in enumerate(spec.ops):
        for kind, arg in zip(OPS[o.op].args, o.args):
            bad = (kind == "value" and isinstance(arg, int) and not 0 <= arg < i
                   or kind == "const" and not (isinstance(arg, int) and 0 <= arg < len(consts)))
            if bad or len(o.args) != len(OPS[o.op].args):
                raise ConfigError(f"app {app!r}: {where}.program.ops[{i}] ({o.op} {o.args}) has arguments its op does "
                                  f"not take (an op's value arguments name earlier ops, const arguments consts); "
                                  f"export the app again")
    if not 0 <= spec.output < len(spec.ops):
        raise ConfigError(f"app {app!r}: {where}.program.output {spec.output} is not one of its {len(spec.ops)} ops")
    return TokenProgram([TokenOp(o.op, tuple(o.args), tuple(o.shape)) for o in spec.ops], consts, spec.output)


def _where(e: ValidationError) -> str:
    """Each schema error as `apps[0].ops.blocks.3.hook_resid_post[0].kind: message`."""
    lines = []
    for err in e.errors():
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
        lines.append(f"  {path}: {err['msg']}")
    return "\n".join(lines)
