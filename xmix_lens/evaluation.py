"""Offline batched evaluation: the rows of a JSONL file through the engine, each with its own apps.

    xmix-lens eval --model smollm2-135m --config apps/ --input rows.jsonl --output results.jsonl \\
        --sweep joy.scale=0,2,4,8
    summary = xmix_lens.evaluate(model, "rows.jsonl", "results.jsonl", sweep=["joy.scale=0,2,4,8"])

A row is a JSON object (the user guide has the whole table):
    {"id": 1, "prompt": "I feel", "apps": ["joy", "probe"], "params": {"joy.scale": 2.0}, "max_new_tokens": 16}
    {"id": 2, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 3}
    {"id": 3, "prompt": "The capital of France is", "target": " Paris", "apps": ["joy"]}   # scored, not generated

Rows go to the engine as a server's requests do (VllmEngine.serve): each chooses its apps and their
request params in its `vllm_xargs`, so rows with different apps and values share every step, and
its CUDA graphs. The input is read lazily and at most a few batches of rows are in flight, so memory
stays flat however long the file. Each finished row's record is appended to the output and flushed:
an interrupted run loses no finished row, and `resume=True` skips the records already there. A row
that cannot run (a malformed row, an unknown app, a value out of its bounds) becomes a record with
an `error` saying why, and the run goes on.
"""
import hashlib
import itertools
import json
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .request_choice import APPS_KEY, READS, READS_KEY, param_problem

# the engine's side (vLLM, the model) is imported when a run starts: `xmix-lens plot` needs neither

GENERATION_FIELDS = {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_at_eos"}
FIELDS = {"id", "prompt", "messages", "target", "apps", "params", "reads"} | GENERATION_FIELDS
_MAX_READ_VALUES = 2**24  # numbers of reads in one record (left_out counts any beyond)


@dataclass
class Summary:
    """What a run did. `records` counts what it wrote (error records included)."""

    output: str
    rows: int = 0  # input rows read
    records: int = 0
    errors: int = 0
    resumed: int = 0  # records already in the output, skipped
    per_engine: list[int] = field(default_factory=list)  # records each data-parallel engine wrote
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        rate = self.records / self.seconds if self.seconds else 0.0
        return (f"{self.records} records ({self.errors} errors) from {self.rows} rows in {self.seconds:.1f} s "
                f"({rate:.1f} records/s); {self.prompt_tokens} prompt and {self.generated_tokens} generated tokens"
                + (f" over {len(self.per_engine)} engines ({'/'.join(map(str, self.per_engine))} records)"
                   if self.per_engine else "")
                + (f"; {self.resumed} already in {self.output}, skipped" if self.resumed else "")
                + f"; written to {self.output}")


@dataclass
class Sweep:
    """`app.param=v1,v2,...`: every row runs with `app` chosen and `param` at each value."""

    app: str
    param: str
    values: list[float]

    @classmethod
    def parse(cls, spec: str) -> "Sweep":
        target, eq, values = spec.partition("=")
        app, dot, param = target.strip().partition(".")
        try:
            numbers = [float(v) for v in values.split(",")] if values.strip() else []
        except ValueError:
            numbers = []
        if not (eq and dot and app and param and numbers and all(map(math.isfinite, numbers))):
            raise ValueError(f"sweep {spec!r}: write app.param=value,value,... (e.g. joy.scale=0,1,2,4)")
        return cls(app, param, numbers)

    def check(self, declared: dict[str, dict[str, tuple[float, float]]]) -> None:
        if self.app not in declared:
            raise ValueError(f"sweep {self.app}.{self.param}: no app named {self.app!r}; the model has {list(declared)}")
        bounds = declared[self.app].get(self.param)
        if bounds is None:
            raise ValueError(f"sweep {self.app}.{self.param}: app {self.app!r} declares no request parameter "
                             f"{self.param!r} (it declares {sorted(declared[self.app])}); declare it with "
                             f"App(request_params={{{self.param!r}: (lowest, highest)}}) and export the app again")
        outside = [v for v in self.values if not bounds[0] <= v <= bounds[1]]
        if outside:
            raise ValueError(f"sweep {self.app}.{self.param}: {outside} lie outside its bounds [{bounds[0]}, {bounds[1]}]")


def sweep_points(sweeps: Iterable[Sweep]) -> list[dict[str, float]]:
    """Every combination of the sweeps' values ({"app.param": value}); [{}] without sweeps."""
    sweeps = list(sweeps)
    names = [f"{s.app}.{s.param}" for s in sweeps]
    if len(set(names)) != len(names):
        raise ValueError(f"a sweep names a parameter twice: {names}")
    return [dict(zip(names, values)) for values in itertools.product(*(s.values for s in sweeps))]


class RowError(ValueError):
    """Why a row cannot run: its record's `error`."""


@dataclass
class _Job:
    """One record to compute: a row under one sweep point, and the requests it waits for."""

    record: dict
    kind: str  # "generate" or "score"
    waiting: set = field(default_factory=set)
    target_len: int = 0
    results: dict = field(default_factory=dict)  # role -> ServedResult


class Evaluation:
    """One run over a model's engine: rows in, records out (see the module's docstring)."""

    def __init__(self, model, sweep: Iterable[str | Sweep] = (), max_new_tokens: int = 16, temperature: float = 0.0,
                 seed: int = 0, in_flight: int | None = None):
        self.model, self.registry = model, model.app_registry
        # the apps a row may choose, in install order (not those the engine holds for generate's hooks)
        self.installed = [n for n in model.engine.installed if n not in model.planner.resident_calls.kept]
        records = {name: self.registry.installed.get(name) for name in self.installed}
        self.declared = {name: record.request_params if record else {} for name, record in records.items()}
        self.reading = {name for name, info in model.engine.installed.items() if info.reads}
        self.outputs = {(name, tuple(key)): out for name in self.installed
                        for key, out in ((records[name].reads if records[name] else None) or {}).items()}
        sweeps = [s if isinstance(s, Sweep) else Sweep.parse(s) for s in sweep]
        for s in sweeps:
            s.check(self.declared)
        self.points = sweep_points(sweeps)
        self.defaults = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        self.seed = seed
        self.in_flight = in_flight or 2 * model.engine.max_num_seqs
        self._keys = itertools.count()

    # --- rows -> requests -------------------------------------------------------------------------
    def jobs(self, row, line: int, point: dict) -> tuple[_Job, list]:
        """A row under one sweep point: its record (without results) and its requests
        (backend/engine.py's ServedRequest), by role."""
        from .backend.engine import ServedRequest

        if not isinstance(row, dict):
            raise RowError(f"a row is a JSON object with an id and a prompt, got {type(row).__name__}")
        unknown = sorted(set(row) - FIELDS)
        if unknown:
            raise RowError(f"unknown field {unknown[0]!r}; a row's fields are {sorted(FIELDS)}")
        names = self._apps(row.get("apps", []), point)
        params = self._params(row.get("params", {}), names, point)
        reads = row.get("reads", READS[0])
        if reads not in READS:
            raise RowError(f"reads {reads!r}: use one of {list(READS)}")
        prompt = self._prompt(row)
        record = {"id": row["id"], "line": line, **({"sweep": point} if point != {} else {}), "apps": list(names),
                  "params": params}
        xargs = self._xargs(names, params, reads)
        wants_reads = bool(set(names) & self.reading) and reads != "none"
        if "target" in row:
            target = row["target"]
            if not isinstance(target, str) or not target:
                raise RowError(f"target {target!r}: a non-empty string, the continuation to score")
            given = sorted(set(row) & GENERATION_FIELDS)
            if given:
                raise RowError(f"a scoring row (with a target) generates nothing; drop {given}")
            ids = self.model.tokenizer(target, add_special_tokens=False)["input_ids"]
            self._check_length(len(prompt) + len(ids))
            job = _Job({**record, "target": target, "target_token_ids": ids}, "score", target_len=len(ids))
            scoring = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
            requests = [("apps", ServedRequest(self._key(), prompt + ids, scoring, xargs, wants_reads))]
            if names:
                requests.append(("without_apps", ServedRequest(self._key(), prompt + ids, scoring,
                                                               self._xargs((), {}, "none"), False)))
            return job, requests
        settings = {**self.defaults, **{k: row[k] for k in GENERATION_FIELDS if k in row}}
        sampling = self._sampling(settings, row["id"], point)
        self._check_length(len(prompt) + sampling["max_tokens"])
        job = _Job({**record, "prompt_tokens": len(prompt)}, "generate")
        return job, [("apps", ServedRequest(self._key(), prompt, sampling, xargs, wants_reads))]

    def _apps(self, apps, point: dict) -> tuple[str, ...]:
        if isinstance(apps, str):
            apps = [a.strip() for a in apps.split(",") if a.strip()]
        if not isinstance(apps, list) or not all(isinstance(a, str) for a in apps):
            raise RowError(f"apps {apps!r}: a list of app names (or one comma-separated string)")
        unknown = [a for a in apps if a not in self.installed]
        if unknown:
            raise RowError(f"no app named {unknown[0]!r}; the model has {self.installed}")
        if len(set(apps)) != len(apps):
            raise RowError(f"apps {apps} names an app twice")
        chosen = set(apps) | {name.partition(".")[0] for name in point}  # a sweep chooses its app
        return tuple(n for n in self.installed if n in chosen)

    def _params(self, params, names: tuple[str, ...], point: dict) -> dict[str, float]:
        if not isinstance(params, dict):
            raise RowError(f"params {params!r}: an object of \"app.param\": number")
        for key, value in params.items():
            app, _, param = str(key).partition(".")
            if key in point:
                raise RowError(f"params sets {key!r}, which the sweep sets; drop it from the row or the sweep")
            problem = param_problem(app, param, value, names, self.declared, f"the row (apps: {list(names)})")
            if problem is not None:
                raise RowError(f"params {key!r} {problem}")
        return {**{k: float(v) for k, v in params.items()}, **point}

    def _prompt(self, row: dict) -> list[int]:
        if "id" not in row or not isinstance(row["id"], (str, int)) or isinstance(row["id"], bool):
            raise RowError("every row needs an \"id\" (a string or an integer): it names the row's records and "
                           "lets --resume skip them")
        if ("prompt" in row) == ("messages" in row):
            raise RowError("a row has a \"prompt\" (text) or chat \"messages\", exactly one")
        tokenizer = self.model.tokenizer
        if "prompt" in row:
            if not isinstance(row["prompt"], str) or not row["prompt"]:
                raise RowError(f"prompt {row['prompt']!r}: a non-empty string")
            return self.model.to_tokens(row["prompt"], truncate=False)[0].tolist()
        messages = row["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise RowError("messages: a non-empty list of {\"role\": ..., \"content\": ...} objects")
        if not getattr(tokenizer, "chat_template", None):
            raise RowError("this model's tokenizer has no chat template: give a \"prompt\" instead of messages")
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))

    def _sampling(self, settings: dict, row_id, point: dict) -> dict:
        from .model import sampling_settings

        n = settings["max_new_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RowError(f"max_new_tokens {n!r}: a whole number of at least 1")
        temperature = settings["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise RowError(f"temperature {temperature!r}: a number >= 0 (0: greedy)")
        for key, ok in (("top_k", lambda v: isinstance(v, int) and v >= 0), ("top_p", lambda v: 0 < v <= 1),
                        ("seed", lambda v: isinstance(v, int)), ("stop_at_eos", lambda v: isinstance(v, bool))):
            if key in settings and (isinstance(settings[key], bool) != (key == "stop_at_eos")
                                    or not isinstance(settings[key], (int, float)) or not ok(settings[key])):
                raise RowError(f"{key} {settings[key]!r} is not valid (top_k: whole >= 0, top_p: in (0, 1], "
                               f"seed: whole, stop_at_eos: true or false)")
        seed = settings.get("seed")
        if seed is None and temperature > 0:  # a row samples the same whatever it shares its steps with
            seed = int.from_bytes(hashlib.sha256(json.dumps([self.seed, row_id, point]).encode()).digest()[:4], "big")
        sampling = sampling_settings(temperature > 0, settings.get("top_k"), settings.get("top_p"), float(temperature),
                                     seed, settings.get("stop_at_eos", True))
        return {**sampling, "max_tokens": n}

    def _xargs(self, names, params: dict, reads: str) -> dict | None:
        if not self.installed:
            return None
        return {APPS_KEY: list(names), READS_KEY: reads, **{f"xmix.{k}": v for k, v in params.items()}}

    def _check_length(self, n: int) -> None:
        limit = self.model.engine.max_model_len
        if n > limit:
            raise RowError(f"the row needs {n} positions; the engine's max_model_len is {limit} (--max-model-len)")

    def _key(self) -> str:
        return f"xmixeval{next(self._keys)}"  # no "-": vLLM appends "-" and a suffix of its own

    # --- results -> records -----------------------------------------------------------------------
    def finish(self, job: _Job) -> dict:
        from .backend.engine import reads_json

        record = job.record
        served = job.results["apps"]
        if job.kind == "generate":
            record.update(completion=self.model.tokenizer.decode(served.tokens, skip_special_tokens=True),
                          token_ids=served.tokens, finish_reason=served.finish_reason)
        else:
            record.update(self._score(served, job.target_len))
            if "without_apps" in job.results:
                record["without_apps"] = self._score(job.results["without_apps"], job.target_len)
        per_prompt = reads_json(served.reads, self.outputs, _MAX_READ_VALUES) if served.reads else []
        record["reads"] = per_prompt[0]["apps"] if per_prompt else {}
        return record

    @staticmethod
    def _score(served, n: int) -> dict:
        logprobs = served.prompt_logprobs[-n:]
        return {"logprob": sum(logprobs), "loss": -sum(logprobs) / n, "token_logprobs": logprobs}


def evaluate(model, input, output, sweep: Iterable[str | Sweep] = (), resume: bool = False, progress: bool = True,
             max_new_tokens: int = 16, temperature: float = 0.0, seed: int = 0, in_flight: int | None = None,
             data_parallel_size: int = 1, config: str | None = None, engine_args: dict | None = None) -> Summary:
    """Run every row of `input` (a JSONL path, or an iterable of row dicts) under each sweep point on
    `model` (a HookedServedModel; its installed apps are what rows choose) and append one record
    per row and point to `output` (JSONL). See the module's docstring and the user guide.

    For speed build the model as `xmix-lens eval` does, with only its apps' hook points armed:
    `from_pretrained(path, config=DIR, armed=())`. A research engine (every hook point armed, the
    default) runs the same rows 0.8x as fast on a GPU where steps exceed its CUDA graphs' sizes.

    `data_parallel_size=N` spreads the rows over N engines, each built in a process of its own on its
    own GPUs (its own CPU cores on the CPU) as `xmix-lens eval` builds one: `model` is then the model's
    name or folder, `config` the app config every engine installs, `engine_args` from_pretrained's other
    keywords (tensor_parallel_size: GPUs per engine). Rows go to whichever engine has room; the records
    are those one engine writes (each row's sampling seed is its own), appended here as they finish."""
    output = Path(output)
    if not resume and output.exists() and output.stat().st_size:
        raise FileExistsError(f"{output} exists and is not empty: pass resume=True (--resume) to continue it, or "
                              f"write to another file")
    sweeps = [s if isinstance(s, Sweep) else Sweep.parse(s) for s in sweep]
    settings = dict(sweep=sweeps, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                    in_flight=in_flight)
    built = not isinstance(model, (str, Path))
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r}: a whole number of engines, at least 1")
    if built and (config is not None or engine_args):
        raise ValueError("config= and engine_args= build engines: with a built model, install the config with "
                         "model.install_config(DIR) instead")
    if data_parallel_size > 1 and built:
        raise ValueError(f"data_parallel_size={data_parallel_size} builds {data_parallel_size} engines, each in a "
                         f"process of its own: pass the model's name or folder (and config=, engine_args=) "
                         f"instead of a built model")
    recipe = EngineRecipe(str(model), config, dict(engine_args or {})) if not built else None
    if recipe is not None:
        check_sweeps(sweeps, recipe)  # before any engine starts
        ranks = recipe.ranks(data_parallel_size)  # enough devices for every engine, or a clear error
    if data_parallel_size == 1:
        model = model if built else recipe.build()
        run = Evaluation(model, **settings)
        points = run.points
    else:
        points = sweep_points(sweeps)
    done = _resume(output) if resume else set()
    summary = Summary(str(output), resumed=0)
    total = (_count_rows(input) * len(points) - len(done)) if isinstance(input, (str, Path)) else None
    with open(output, "a", encoding="utf-8") as out, _progress(progress, total) as bar:
        started = time.perf_counter()

        def write(record: dict, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()
            summary.records += 1
            summary.errors += "error" in record
            summary.prompt_tokens += prompt_tokens
            summary.generated_tokens += generated_tokens
            summary.seconds = time.perf_counter() - started
            bar.update(1)
            bar.set_postfix_str(f"{(summary.prompt_tokens + summary.generated_tokens) / summary.seconds:.0f} tok/s",
                                refresh=False)

        if data_parallel_size == 1:
            with model.lock:
                _serve_rows(model, run, _pending(input, points, done, summary, write), write)
        else:
            def ready() -> None:  # rows/s from the engines ready, as one engine's run counts after its build
                nonlocal started
                started = time.perf_counter()

            summary.per_engine = [0] * data_parallel_size

            def write_from(rank: int, record: dict, *tokens: int) -> None:
                if rank >= 0:  # not an error record found while reading
                    summary.per_engine[rank] += 1
                write(record, *tokens)

            _serve_rows_in_parallel(recipe, ranks, settings,
                                    lambda write_error: _pending(input, points, done, summary, write_error),
                                    write_from, ready)
        summary.seconds = time.perf_counter() - started
    return summary


@dataclass
class EngineRecipe:
    """How `xmix-lens eval` builds an engine: the model's name or folder, the app config it installs
    (only its apps' hook points armed), from_pretrained's other keywords."""

    model: str
    config: str | None
    engine_args: dict

    def build(self):
        from .model import HookedTransformer

        return HookedTransformer.from_pretrained(self.model, config=self.config, armed=(), **self.engine_args)

    def ranks(self, n: int) -> list[dict[str, str]]:
        """Each engine's environment: its GPUs (CUDA_VISIBLE_DEVICES, tensor_parallel_size ×
        pipeline_parallel_size of them), or on the CPU its share of this process's cores (vLLM's
        VLLM_CPU_OMP_THREADS_BIND, one list per rank), so that N engines do not run on the same ones."""
        import torch

        tp = int(self.engine_args.get("tensor_parallel_size", self.engine_args.get("n_devices", 1))) * \
            int(self.engine_args.get("pipeline_parallel_size", 1))  # an engine's ranks
        if n == 1:
            return [{}]
        if torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            if len(devices) < n * tp:
                raise ValueError(f"data_parallel_size={n} engines of {tp} GPUs each (tensor × pipeline parallel "
                                 f"sizes) need {n * tp} GPUs; {len(devices)} are visible: lower data_parallel_size")
            return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[r * tp:(r + 1) * tp])} for r in range(n)]
        cores = sorted(os.sched_getaffinity(0))
        per_rank = len(cores) // (n * tp)
        if per_rank == 0:  # fewer cores than ranks: they share them, as vLLM's own binding would
            return [{} for _ in range(n)]
        lists = [",".join(map(str, cores[i * per_rank:(i + 1) * per_rank])) for i in range(n * tp)]
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(lists[r * tp:(r + 1) * tp])} for r in range(n)]


def check_sweeps(sweeps: list[Sweep], recipe: EngineRecipe) -> None:
    """Each sweep names an app of the recipe's config and a parameter it declares (before any engine)."""
    from . import app_config
    from .model_files import resolve_model

    if not sweeps:
        return
    if recipe.config is None:
        raise ValueError(f"the sweep {sweeps[0].app}.{sweeps[0].param} needs an app config (config=, --config)")
    declared = {spec.name: {p.name: (p.minimum, p.maximum) for p in spec.params}
                for spec, _ in app_config.read(recipe.config, resolve_model(recipe.model))}
    for s in sweeps:
        s.check(declared)


def _pending(input, points: list[dict], done: set, summary: Summary, write) -> Iterator[tuple[int, object, dict]]:
    """(line, row, sweep point) of every row and point not already in the output, read lazily. A line
    that is not JSON, and a row whose id another line used, are written as error records here."""
    seen: dict[str, int] = {}  # id -> the line that used it
    for line, row in _rows(input):
        summary.rows += 1
        row_id = row.get("id") if isinstance(row, dict) else None
        id_key = json.dumps(row_id) if isinstance(row_id, (str, int)) else f"line {line}"
        for point in points:
            if (id_key, json.dumps(point, sort_keys=True)) in done:
                summary.resumed += 1
                continue
            if isinstance(row, RowError):
                write(_error_record(row_id, line, point, row))
            elif id_key in seen and seen[id_key] != line:
                write(_error_record(row_id, line, point, RowError(
                    f"id {row_id!r} was used by line {seen[id_key]}: ids name a row's records and let --resume "
                    f"skip them, so they must be unique")))
            else:
                seen[id_key] = line
                yield line, row, point


def _error_record(row_id, line: int, point: dict, error: RowError) -> dict:
    return {"id": row_id, "line": line, **({"sweep": point} if point != {} else {}), "error": str(error)}


def _serve_rows(model, run: Evaluation, items: Iterable[tuple[int, object, dict]], write) -> None:
    """Rows through one engine as a server's requests; `write(record, prompt_tokens, generated_tokens)`
    as each row finishes."""
    waiting: dict[str, tuple[_Job, str]] = {}  # request key -> (job, role)
    tokens: dict[int, list[int]] = {}  # id(job) -> [prompt, generated]

    def requests() -> Iterator:
        for line, row, point in items:
            try:
                job, served = run.jobs(row, line, point)
            except RowError as e:
                write(_error_record(row.get("id") if isinstance(row, dict) else None, line, point, e))
                continue
            tokens[id(job)] = [0, 0]
            for role, request in served:
                job.waiting.add(request.key)
                waiting[request.key] = (job, role)
                yield request

    for served in model.engine.serve(requests(), run.in_flight):
        job, role = waiting.pop(served.key)
        job.results[role] = served
        job.waiting.discard(served.key)
        counts = tokens[id(job)]
        counts[0] += served.prompt_tokens
        counts[1] += len(served.tokens) if job.kind == "generate" else 0
        if not job.waiting:
            write(run.finish(job), *tokens.pop(id(job)))


def _serve_rows_in_parallel(recipe: EngineRecipe, ranks: list[dict], settings: dict, pending, write, ready) -> None:
    """Rows over len(ranks) engines, each built by `recipe` in a process of its own with its rank's
    environment. `pending(write_error)` gives the rows. A feeding thread puts them on one bounded queue that every engine takes from
    (an engine with room takes the next row: none waits on a slower one, memory stays flat); records
    come back on another and are written here, by this thread alone, as they finish
    (`write(rank, record, prompt_tokens, generated_tokens)`, rank -1 for errors found while reading);
    `ready()` once every engine is built: rows flow from then, so that none takes the first rows alone."""
    import multiprocessing
    import queue
    import threading

    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA or vLLM state inherited
    rows, results = context.Queue(maxsize=64 * len(ranks)), context.Queue()
    # not daemons: an engine of several GPUs starts worker processes of its own
    engines = [context.Process(target=_engine_rank, args=(rank, env, recipe, settings, rows, results))
               for rank, env in enumerate(ranks)]
    for engine in engines:
        engine.start()

    all_built = threading.Event()

    def feed() -> None:
        all_built.wait()
        # error records found while reading go back through the results queue: one thread writes
        for item in pending(lambda record: results.put(("record", -1, record, 0, 0))):
            rows.put(item)
        for _ in engines:
            rows.put(None)

    feeding = threading.Thread(target=feed, daemon=True)
    feeding.start()
    finished, built = 0, 0
    try:
        while finished < len(engines):
            try:
                message = results.get(timeout=1.0)
            except queue.Empty:
                stopped = [r for r, e in enumerate(engines) if e.exitcode not in (None, 0)]
                if stopped:
                    raise RuntimeError(f"data-parallel engine {stopped[0]} stopped (exit code "
                                       f"{engines[stopped[0]].exitcode}); the finished records are written: "
                                       f"continue with resume") from None
                continue
            kind = message[0]
            if kind == "record":
                write(*message[1:])
            elif kind == "ready":
                built += 1
                if built == len(engines):
                    ready()
                    all_built.set()
            elif kind == "done":
                finished += 1
            else:  # "failed": the rank's traceback
                raise RuntimeError(f"data-parallel engine {message[1]} failed; the finished records are written: "
                                   f"continue with resume.\n{message[2]}")
    finally:
        for engine in engines:
            if engine.is_alive() and finished < len(engines):
                engine.terminate()
            engine.join()


def _engine_rank(rank: int, env: dict, recipe: EngineRecipe, settings: dict, rows, results) -> None:
    """One data-parallel engine's process: built with its rank's devices, it serves rows from the
    shared queue until the end marker and sends each record back."""
    import traceback

    os.environ.update(env)
    try:
        model = recipe.build()
        run = Evaluation(model, **settings)
        results.put(("ready", rank))
        with model.lock:
            _serve_rows(model, run, iter(rows.get, None),
                        lambda record, *tokens: results.put(("record", rank, record, *tokens)))
        results.put(("done", rank))
        model.shutdown()
    except BaseException:
        results.put(("failed", rank, traceback.format_exc()))


def _rows(input) -> Iterator[tuple[int, dict | RowError]]:
    """(line number, row) of a JSONL file read lazily (blank lines skipped; a line that is not JSON
    comes as a RowError), or of an iterable of dicts (numbered from 1)."""
    if not isinstance(input, (str, Path)):
        yield from enumerate(input, start=1)
        return
    with open(input, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield line, json.loads(text)
            except json.JSONDecodeError as e:
                yield line, RowError(f"line {line} is not JSON ({e.msg} at column {e.colno})")


def _count_rows(path) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for text in f if text.strip())


def _resume(output: Path) -> set[tuple[str, str]]:
    """The (id, sweep point) keys of the records already in `output`. A last line cut short by an
    interruption is removed, so that the file holds whole records only."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(whole))
    done = set()
    for text in whole.decode("utf-8").splitlines():
        if text.strip():
            record = json.loads(text)
            row_id = record.get("id")
            id_key = json.dumps(row_id) if isinstance(row_id, (str, int)) else f"line {record['line']}"
            done.add((id_key, json.dumps(record.get("sweep", {}), sort_keys=True)))
    return done


def _progress(enabled: bool, total: int | None):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True, desc="eval")


# --- curves of a results file ---------------------------------------------------------------------
Point = tuple[float, float, float, int]  # (value of the swept x, mean of y, its standard error, records)


@dataclass
class Curve:
    """One line of a plot: `points` of y against the swept x over the records of one group (all of
    them without `by`); `baseline`: the same records' `without_apps.` score (empty where they have
    none: reads, generated rows, rows without apps)."""

    by: str | None  # the grouping field
    value: object  # that field's value in this group's records (None: all records, or records without it)
    points: list[Point]
    baseline: list[Point] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.by is None:
            return "all rows"
        if self.value is None:
            return f"no {self.by}"
        return f"{self.by}={self.value!r}" if isinstance(self.value, str) else f"{self.by}={json.dumps(self.value)}"


def sweep_curve(results, x: str, y: str) -> list[Point]:
    """(value of the swept `x`, mean of `y`, its standard error, records) for each value of `x`, over
    the records of a results file without errors. `y`: a record's number ("logprob", "loss",
    "without_apps.logprob", ...) or "reads.APP.OUTPUT", a scalar read at its first position returned
    (the prompt's end by default)."""
    return sweep_curves(results, x, y)[0].points


def sweep_curves(results, x: str, y: str, by: str | None = None) -> list[Curve]:
    """sweep_curve's points for each value of the record field `by` (one Curve each, in the order the
    values first appear; all records in one Curve without `by`), each with its baseline: for a score
    `y` ("logprob", "loss"), the same records' `without_apps.` score, where they have it.

    `by`: a record field ("target", "id", "apps"), a dotted path into one ("params.joy.scale"), or
    another swept parameter of a grid ("sad.scale"). A record without the field is in the group of
    value None; `target` falls back to `target_token_ids` in records written before records held it."""
    base_y = None if y.split(".")[0] in ("reads", "without_apps") else f"without_apps.{y}"
    groups: dict[str, tuple[object, dict[float, list[float]], dict[float, list[float]]]] = {}
    for _, record in _rows(results):
        if isinstance(record, RowError) or "error" in record:
            continue
        point = record.get("sweep", {})
        if x not in point:
            raise ValueError(f"{results}: a record (line {record.get('line')}) has no swept {x!r}; its sweep is "
                             f"{point or 'empty'}: run eval with --sweep {x}=...")
        value = _number(record, y)
        if value is None:  # (scores are in scoring rows' records only, a read in its apps' records)
            continue
        key = _group(record, by) if by is not None else None
        _, ys, base = groups.setdefault(json.dumps(key, sort_keys=True), (key, {}, {}))
        ys.setdefault(point[x], []).append(value)
        baseline = _number(record, base_y) if base_y is not None else None
        if baseline is not None:
            base.setdefault(point[x], []).append(baseline)
    if not groups:
        raise ValueError(f"{results} has no record with {y!r} (and without an error)")
    return [Curve(by, key, _points(ys), _points(base)) for key, ys, base in groups.values()]


def _points(by_x: dict[float, list[float]]) -> list[Point]:
    points = []
    for value in sorted(by_x):
        ys = by_x[value]
        mean = sum(ys) / len(ys)
        spread = math.sqrt(sum((v - mean) ** 2 for v in ys) / (len(ys) - 1) / len(ys)) if len(ys) > 1 else 0.0
        points.append((value, mean, spread, len(ys)))
    return points


def _group(record: dict, by: str):
    """A record's value of `by` (see sweep_curves); None if it has none."""
    found = _field(record, by.split("."))
    if found is _MISSING and by in record.get("sweep", {}):
        found = record["sweep"][by]
    if found is _MISSING and by == "target":
        found = _field(record, ["target_token_ids"])
    return None if found is _MISSING else found


_MISSING = object()


def _field(value, parts: list[str]):
    """value[a][b]... for the dotted path `parts`, where a key may itself hold dots ("joy.scale")."""
    if not parts:
        return value
    if not isinstance(value, dict):
        return _MISSING
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in value:
            found = _field(value[key], parts[n:])
            if found is not _MISSING:
                return found
    return _MISSING


def _number(record: dict, y: str) -> float | None:
    """A record's `y` (see sweep_curve), None if the record has none."""
    parts = y.split(".")
    if parts[0] == "reads":
        if len(parts) != 3:
            raise ValueError(f"y {y!r}: write reads.APP.OUTPUT (e.g. reads.probe.score)")
        read = record["reads"].get(parts[1], {}).get(parts[2])
        if read is None or not read["values"]:
            return None
        value = read["values"][0]
    else:
        value = record
        for part in parts:
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{y!r} is not a number in record {record['id']!r} (it is {str(value)[:60]}): plot a "
                         f"scalar read or score")
    return float(value)


def plot(results, x: str, y: str, out, by: str | None = None) -> Path:
    """The curves of `y` against the swept `x` (sweep_curves: one per value of `by`, means with
    standard-error bars), each with its baseline without apps dashed beside it where the records
    have one, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = sweep_curves(results, x, y, by)
    counts = sorted({p[3] for c in curves for p in c.points})
    rows = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    fig, ax = plt.subplots(figsize=(6, 4))
    handles = []  # each curve's legend entry beside its baseline's
    for i, curve in enumerate(curves):
        color = f"C{i % 10}"
        handles.append(ax.errorbar([p[0] for p in curve.points], [p[1] for p in curve.points],
                                   yerr=[p[2] for p in curve.points], marker="o", capsize=3, color=color,
                                   label=f"{curve.label}, with apps" if curve.baseline else curve.label))
        if curve.baseline:
            handles += ax.plot([p[0] for p in curve.baseline], [p[1] for p in curve.baseline], linestyle="--",
                               color=color, alpha=0.8, label=f"{curve.label}, without apps")
    ax.set_xlabel(x)
    ax.set_ylabel(f"{y}\n(mean ± standard error over {rows} rows)")
    ax.set_title(f"{y} against {x}" + (f", by {by}" if by else ""), fontsize=9)
    if len(handles) > 1:
        ax.legend(handles=handles, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
