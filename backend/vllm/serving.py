"""Choosing apps per request over vLLM's OpenAI API: the API server's side, as a `vllm.endpoint_plugins` entry.

vLLM loads endpoint plugins only when `VLLM_PLUGINS` names them (`xmix-lens serve` sets
VLLM_PLUGINS=xmix_lens; an engine serving a config refuses to start without it: instrumented.py).
`AppsEndpoint` reads the server's app config from its arguments (`--additional-config`) in each
API-server process and adds `CheckChoices`, a middleware that sees every request's JSON before vLLM
parses it. A request whose `vllm_xargs` say anything to xmix-lens is
  - answered HTTP 400 in vLLM's error shape if the choice is bad (request_choice.chosen_apps), or
    if it came to an endpoint other than completions and chat completions;
  - else given a prefix-cache salt of its choice (request_choice.salt: its apps and param values;
    the client's own salt kept in front), so that KV blocks are shared only between requests that
    chose the same. A request that wants every position's reads gets a salt of its own: it computes
    every position, and its reads cover every position they promise.
Then the engine's workers select the apps for each request's tokens from the same `vllm_xargs`
(adapter._follow_request_choices). The response of a request that wants reads (`WithReads`) gets them
once it is complete, fetched from the workers (`ReadFetcher`: the responses waiting share one
collective RPC at a time, which waits for no step on the device); a stream that wants its prompt's
end asks as its first token goes out, so that the fetch is done before its last. The middleware names each such
request (its `request_id`, unless the client named it), so that a request whose client goes away
before its reads are fetched is forgotten by name. `/metrics` counts the requests choosing each app
(`xmix_app_requests_total`, in every API server), the fetches and the engine's time answering them
(`xmix_read_fetches_total`, `xmix_read_fetch_engine_seconds_total`) and how long responses waited
for their reads (`xmix_read_wait_seconds`).

Why not a logits processor's `validate_params` (vLLM's documented per-request check)? Installing
one as an entry point makes vLLM 0.26 give up its V2 model runner for every engine on the machine
("Model Runner V2 does not yet support custom logits processors", seen 2026-12-01 on the H200).
"""
import asyncio
import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram
from vllm.logger import init_logger

from xmix_lens import app_config
from xmix_lens.request_choice import asks_for_apps, chosen_apps, reads_wanted, salt

from ..engine import reads_json
from .adapter import rpc_on_every_engine
from .remote import merge_stage_reads

logger = init_logger("vllm.xmix_lens")
SALTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests whose cache_salt vLLM honours
ID_PREFIXES = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-"}  # vLLM's, before the request id
APP_REQUESTS = Counter("xmix_app_requests", "Requests that chose each xmix-lens app (vllm_xargs)", ["app"])
READS_HELD = Gauge("xmix_reads_held", "Requests whose reads the engine keeps for a fetch (running, or finished "
                   "and not fetched), as this API server's last fetch found")
READ_FETCHES = Counter("xmix_read_fetches", "Collective RPCs of this API server fetching reads from the engine")
READ_FETCH_ENGINE = Counter("xmix_read_fetch_engine_seconds", "Time the engine's worker took answering this API "
                            "server's read fetches (the engine's steps wait for it)")
READ_WAIT = Histogram("xmix_read_wait_seconds", "Time a response waited for its reads after its last token",
                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))


MAX_READ_VALUES = 65536  # numbers per response: the latest positions that fit are returned, the count left out said


class ServedConfig(NamedTuple):
    """What the API server knows of the engine's apps."""

    names: tuple[str, ...]  # in install order
    reading: frozenset[str]  # apps with reads
    digest: str  # of the manifest: salts differ across configs
    outputs: dict = {}  # (app, read key) -> (output name, feature shape)
    params: dict = {}  # app -> {request param: (lowest, highest)}


_served: ServedConfig | None = None  # this API-server process's, set by AppsEndpoint.init_state
_fetcher: "ReadFetcher | None" = None  # its fetches of reads from the engine's workers


def config_folder(additional_config) -> str | None:
    extra = json.loads(additional_config) if isinstance(additional_config, str) else additional_config or {}
    return (extra.get("xmix_lens") or {}).get("config") if isinstance(extra, dict) else None


def load_served(folder: str, model: str) -> ServedConfig:
    apps = app_config.read(folder, model)  # the engine's own loader and checks
    digest = hashlib.sha256((Path(folder) / app_config.MANIFEST).read_bytes()).hexdigest()
    outputs = {(spec.name, key): read for spec, _ in apps for key, read in app_config.reads_of(spec).items()}
    params = {spec.name: {p.name: (p.minimum, p.maximum) for p in spec.params} for spec, _ in apps}
    return ServedConfig(tuple(spec.name for spec, _ in apps), frozenset(spec.name for spec, _ in apps if spec.reads),
                        digest, outputs, params)


class AppsEndpoint:
    """The `vllm.endpoint_plugins` factory: no routes of its own, the checking middleware."""

    name = "xmix_lens"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.add_middleware(CheckChoices)

    async def init_state(self, engine_client, state, args) -> None:
        global _served, _fetcher
        _fetcher = ReadFetcher(engine_client)
        folder = config_folder(getattr(args, "additional_config", None))
        _served = load_served(folder, args.model) if folder else None
        if _served:
            logger.info("xmix-lens: this API server takes app choices for %s", list(_served.names))


class BadChoice(ValueError):
    """A request's app choice that the server refuses (HTTP 400)."""


class Reading(NamedTuple):
    """A request whose response gets reads: the id vLLM gives it, and whether its reads are complete
    once its first token is out (it wants its prompt's end only): a stream fetches them then."""

    api_id: str
    at_first_token: bool


def checked(body: bytes, path: str, header_id: str | None = None) -> tuple[bytes, Reading | None]:
    """A request body as the engine must see it: unchanged if it says nothing to xmix-lens, else
    with its choice's cache salt; and if it chose an app that reads (its response gets the reads),
    its `Reading`: the id vLLM gives it is its X-Request-Id header's (`header_id`), else its body's
    `request_id`, which is set here where the client set none. BadChoice names what is wrong."""
    try:
        request = json.loads(body)
    except ValueError:
        return body, None
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    if not isinstance(xargs, dict) or not asks_for_apps(xargs):
        return body, None
    if _served is None:
        raise BadChoice("this server takes no app choices (vllm_xargs with xmix keys): it serves no xmix-lens app "
                        "config. Start it with `xmix-lens serve DIR -- MODEL ...`")
    try:
        names = chosen_apps(xargs, {name: _served.params.get(name, {}) for name in _served.names})
    except ValueError as e:
        raise BadChoice(str(e)) from None
    if path not in SALTED_PATHS:
        raise BadChoice(f"apps are chosen through {' and '.join(SALTED_PATHS)}, not {path}")
    reading = bool(set(names) & _served.reading) and reads_wanted(xargs) != "none"
    if reading and (request.get("n") or 1) != 1:  # vLLM gives each sample an id of its own: no reads could follow
        raise BadChoice(f"reads come back for one sample per prompt (n = 1), not n = {request['n']}; ask for "
                        "n = 1, or for no reads (\"xmix_reads\": \"none\")")
    choice_salt = salt(xargs, _served.digest, _served.reading)
    client_salt = request.get("cache_salt")
    request["cache_salt"] = f"{client_salt}|{choice_salt}" if isinstance(client_salt, str) and client_salt \
        else choice_salt
    for name in names:
        APP_REQUESTS.labels(app=name).inc()
    read = None
    if reading:
        if header_id is None and not (isinstance(request.get("request_id"), str) and request["request_id"]):
            request["request_id"] = uuid.uuid4().hex
        read = Reading(ID_PREFIXES[path] + (header_id if header_id is not None else request["request_id"]),
                       reads_wanted(xargs) == "prompt_end")
    return json.dumps(request).encode(), read


class CheckChoices:
    """ASGI middleware: every POST body but uploads through `checked` before vLLM reads it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or _multipart(scope):
            return await self.app(scope, receive, send)  # an upload (audio): streamed on, never buffered
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        header_id = dict(scope.get("headers", [])).get(b"x-request-id")
        try:
            body, reading = checked(b"".join(chunks), scope["path"], header_id and header_id.decode())
        except BadChoice as e:
            return await _bad_request(send, str(e))
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        replayed = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        if reading is None:
            return await self.app(scope, replayed, send)
        response = WithReads(send, reading)
        try:
            await self.app(scope, replayed, response.send)
        finally:
            if not response.fetched:  # an error, or its client went away: nobody takes its reads
                _fetcher.forget(reading.api_id)


class WithReads:
    """The response of a request that chose reading apps (`reading`), with the reads added: a JSON
    response gets an `xmix_reads` field; a stream gets one more event before `data: [DONE]`, a chunk
    with no choices and `xmix_reads` (as vLLM's own usage chunk has no choices). A stream whose reads
    are complete at its first token fetches them as that token goes out: the fetch's round trip
    through the engine's step loop (tens of milliseconds at 128 requests) overlaps the generation
    instead of holding the response's end."""

    def __init__(self, send, reading: Reading):
        self._send, self.api_id, self.reading = send, reading.api_id, reading
        self.start, self.body, self.streaming, self.fetched = None, [], False, False
        self._early: asyncio.Future | None = None  # the fetch started at the first token

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            self.streaming = dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/event-stream")
            if self.streaming or message["status"] != 200:
                self.start = None
                await self._send(message)
            return
        if self.start is None and not self.streaming:  # an error response: as it is
            return await self._send(message)
        if self.streaming:
            return await self._stream(message)
        self.body.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        response = json.loads(b"".join(self.body))
        response["xmix_reads"] = await self._reads()
        body = json.dumps(response).encode()
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self._send(dict(self.start, headers=headers + [(b"content-length", str(len(body)).encode())]))
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, message) -> None:
        chunk = message.get("body", b"")
        done = chunk.find(b"data: [DONE]")
        if self._early is None and self.reading.at_first_token and done < 0 and chunk:
            self._early = asyncio.ensure_future(_fetcher.reads(self.api_id, early=True))
        if done >= 0:
            reads = {"id": self.api_id, "object": "xmix.reads", "choices": [], "xmix_reads": await self._reads()}
            chunk = chunk[:done] + b"data: " + json.dumps(reads).encode() + b"\n\n" + chunk[done:]
        await self._send(dict(message, body=chunk))

    async def _reads(self) -> list[dict]:
        """As docs/serving.md shows them: per prompt, per app and output, the positions read and their values."""
        asked = time.monotonic()
        per_prompt = await (self._early if self._early is not None else _fetcher.reads(self.api_id))
        READ_WAIT.observe(time.monotonic() - asked)
        self.fetched = True
        return reads_json(per_prompt, _served.outputs, MAX_READ_VALUES)


class ReadFetcher:
    """An API server's fetches of finished requests' reads from the engine's workers (rank 0
    answers; under data parallelism each engine's, merged): one collective RPC at a time (a utility
    call the engine core answers between steps) carries every response waiting, and the requests to
    forget. A request with a step still on the device is asked for again after RETRY_S, and waited
    for (a drain) once asked for WAIT_S: the engine may have gone idle before that step's reads were
    queued home."""

    RETRY_S = 0.002
    WAIT_S = 0.05

    def __init__(self, engine):
        self.engine = engine
        # API request id -> (its reads, asked at, whether it may still run)
        self.waiting: dict[str, tuple[asyncio.Future, float, bool]] = {}
        self.forgotten: list[str] = []
        # under data parallelism, the reads of a waiting request some engines have given (and forgotten)
        self.gathered: dict[str, list] = {}
        self._fetching: asyncio.Task | None = None

    async def reads(self, api_id: str, early: bool = False) -> list:
        """Its reads; `early`: asked while it may still run (answered once they are complete)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[api_id] = (future, time.monotonic(), early)
        self._start()
        return await future

    def forget(self, api_id: str) -> None:
        self.forgotten.append(api_id)
        self._start()

    def _start(self) -> None:
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.ensure_future(self._fetch())

    async def _fetch(self) -> None:
        while self.waiting or self.forgotten:
            asked, forget, self.forgotten = list(self.waiting), self.forgotten, []
            early = [a for a in asked if self.waiting[a][2]]
            # a drain waits for the newest step: only for a finished request's last steps, never for a running one
            wait = any(time.monotonic() - self.waiting[a][1] > self.WAIT_S for a in asked if not self.waiting[a][2])
            try:
                answers, held, seconds = engine_reads(await rpc_on_every_engine(
                    self.engine, "xmix_take_reads", (asked, forget, wait, early)))
            except Exception as e:  # the engine is gone: every response waiting says so
                for future, *_ in self.waiting.values():
                    if not future.done():
                        future.set_exception(e)
                self.waiting.clear()
                return
            READS_HELD.set(held)
            READ_FETCHES.inc()
            READ_FETCH_ENGINE.inc(seconds)
            for api_id, reads in gather_engine_reads(self.gathered, answers, forget).items():
                if reads is not None:
                    future, *_ = self.waiting.pop(api_id)
                    if not future.done():  # its client went away meanwhile
                        future.set_result(reads)
            if set(self.waiting) <= set(asked) and not self.forgotten:  # none came meanwhile
                await asyncio.sleep(self.RETRY_S)


def engine_reads(engines: list[list[tuple[dict | None, int, float]]]) -> tuple[list[dict], int, float]:
    """One fetch's answer from each engine's workers: each engine's reads, the reads held and the
    seconds taken (each engine's most, summed). The workers that deliver reads (each pipeline stage's
    first tensor-parallel rank; the others answer None) hold those of their stage's hook points
    (remote.merge_stage_reads)."""
    answers = []
    for workers in engines:
        delivered = [answer for answer in workers if answer[0] is not None]
        answers.append((merge_stage_reads([taken for taken, _, _ in delivered]),
                        max(held for _, held, _ in delivered), max(seconds for _, _, seconds in delivered)))
    return ([taken for taken, _, _ in answers], sum(held for _, held, _ in answers),
            sum(seconds for _, _, seconds in answers))


def gather_engine_reads(gathered: dict[str, list], answers: list[dict], forget=()) -> dict:
    """The requests whose reads are complete after one fetch, from each engine's answer. Under data
    parallelism a request's prompts may land on any engine; one that holds none of them answers an
    empty list, one still computing some None. An engine that answers hands its reads over and forgets
    them, so they are `gathered` until every engine has answered; then a request's reads are its
    prompts' from every engine, by prompt index. Others: None (asked again)."""
    for api_id in forget:
        gathered.pop(api_id, None)
    complete = {}
    for api_id in answers[0]:
        parts = [taken[api_id] for taken in answers]
        kept = gathered.setdefault(api_id, [])
        kept.extend(entry for part in parts if part is not None for entry in part)
        done = all(part is not None for part in parts)
        complete[api_id] = sorted(gathered.pop(api_id), key=lambda read: read[0]) if done else None
    return complete


def _multipart(scope) -> bool:
    """A form upload: vLLM reads no vllm_xargs from one (any other body is checked, whatever its
    declared type: FastAPI may parse it as JSON)."""
    return dict(scope.get("headers", [])).get(b"content-type", b"").lower().startswith(b"multipart/")


def _replay(messages: list, receive):
    async def replayed():
        return messages.pop(0) if messages else await receive()
    return replayed


async def _bad_request(send, message: str) -> None:
    """HTTP 400 in the shape of vLLM's own errors (an OpenAI error object)."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "vllm_xargs",
                                 "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
