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
(adapter._follow_request_choices). The response of a request that wants reads (`WithReads`) gets them,
fetched from the workers by collective RPC once the response is complete.

Why not a logits processor's `validate_params` (vLLM's documented per-request check)? Installing
one as an entry point makes vLLM 0.26 give up its V2 model runner for every engine on the machine
("Model Runner V2 does not yet support custom logits processors", seen 2026-12-01 on the H200).
"""
import hashlib
import json
from pathlib import Path
from typing import NamedTuple

from vllm.logger import init_logger

from xmix_lens import app_config
from xmix_lens.request_choice import asks_for_apps, chosen_apps, reads_wanted, salt

from ..engine import reads_json

logger = init_logger("vllm.xmix_lens")
SALTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # the requests whose cache_salt vLLM honours


MAX_READ_VALUES = 65536  # numbers per response: the latest positions that fit are returned, the count left out said


class ServedConfig(NamedTuple):
    """What the API server knows of the engine's apps."""

    names: tuple[str, ...]  # in install order
    reading: frozenset[str]  # apps with reads
    digest: str  # of the manifest: salts differ across configs
    outputs: dict = {}  # (app, read key) -> (output name, feature shape)
    params: dict = {}  # app -> {request param: (lowest, highest)}


_served: ServedConfig | None = None  # this API-server process's, set by AppsEndpoint.init_state
_engine = None  # its engine client: reads are fetched from the workers by collective RPC


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
        global _served, _engine
        _engine = engine_client
        folder = config_folder(getattr(args, "additional_config", None))
        _served = load_served(folder, args.model) if folder else None
        if _served:
            logger.info("xmix-lens: this API server takes app choices for %s", list(_served.names))


class BadChoice(ValueError):
    """A request's app choice that the server refuses (HTTP 400)."""


def checked(body: bytes, path: str) -> tuple[bytes, bool]:
    """A request body as the engine must see it: unchanged if it says nothing to xmix-lens, else
    with its choice's cache salt; and whether it chose an app that reads (its response gets the
    reads). BadChoice names what is wrong."""
    try:
        request = json.loads(body)
    except ValueError:
        return body, False
    xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
    if not isinstance(xargs, dict) or not asks_for_apps(xargs):
        return body, False
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
    return json.dumps(request).encode(), reading


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
        try:
            body, reading = checked(b"".join(chunks), scope["path"])
        except BadChoice as e:
            return await _bad_request(send, str(e))
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        scope = dict(scope, headers=headers + [(b"content-length", str(len(body)).encode())])
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive),
                       WithReads(send).send if reading else send)


class WithReads:
    """The response of a request that chose reading apps, with the reads added: a JSON response gets
    an `xmix_reads` field; a stream gets one more event before `data: [DONE]`, a chunk with no
    choices and `xmix_reads` (as vLLM's own usage chunk has no choices)."""

    def __init__(self, send):
        self._send, self.start, self.body, self.request_id, self.streaming = send, None, [], None, False

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
        response["xmix_reads"] = await fetch_reads(response["id"])
        body = json.dumps(response).encode()
        headers = [(k, v) for k, v in self.start.get("headers", []) if k.lower() != b"content-length"]
        await self._send(dict(self.start, headers=headers + [(b"content-length", str(len(body)).encode())]))
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _stream(self, message) -> None:
        chunk = message.get("body", b"")
        if self.request_id is None and b"data: {" in chunk:
            event = chunk[chunk.index(b"data: {") + 6:].split(b"\n", 1)[0]
            try:
                self.request_id = json.loads(event).get("id")
            except ValueError:  # an event split over chunks: the next one names the request too
                pass
        done = chunk.find(b"data: [DONE]")
        if done >= 0 and self.request_id is not None:
            reads = {"id": self.request_id, "object": "xmix.reads", "choices": [],
                     "xmix_reads": await fetch_reads(self.request_id)}
            chunk = chunk[:done] + b"data: " + json.dumps(reads).encode() + b"\n\n" + chunk[done:]
        await self._send(dict(message, body=chunk))


async def fetch_reads(request_id: str) -> list[dict]:
    """The reads of a finished request, from the engine's workers (rank 0 answers), as documented in
    docs/serving.md: per prompt, per app and output, the positions read and their values."""
    answers = await _engine.collective_rpc("xmix_take_reads", args=(request_id,))
    return reads_json(answers[0], _served.outputs, MAX_READ_VALUES)


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
