"""A served request's choice of apps, read from its `vllm_xargs` (vLLM's `SamplingParams.extra_args`).

    {"vllm_xargs": {"xmix_apps": "steer,probe"}}      or a list: ["steer", "probe"]
    {"vllm_xargs": {"xmix_apps": "probe", "xmix_reads": "all"}}

`xmix_apps` names installed apps ("" or [] chooses none: the native path). `xmix_reads` says which
positions of the chosen apps' reads come back with the response: "prompt_end" (the default: the
prompt's last token, where a detector or a probe of the request decides), "last" (the latest token
the engine ran), "all" (every position), or "none". A request with no key
starting with "xmix" is not ours and runs as the server's defaults say. Everything else under
"xmix" is refused with the reason, never ignored: a typo (`xmix_app`) must not run a request
without the apps it asked for. `xmix.<app>.<param>` sets a parameter the app declares for requests
(a number within its bounds) for this request alone.

`salt` keys the prefix cache by choice: two requests share KV blocks only if they chose the same
apps, with the same param values, of the same config (the API server puts it in `cache_salt`).

The parsing lives here, without vLLM: the API server (which answers HTTP 400) and the engine's
workers (which select the apps for the request's tokens) read a choice the same way.
"""
import hashlib
import json
import math
import uuid
from collections.abc import Collection, Mapping, Sequence

APPS_KEY = "xmix_apps"
READS_KEY = "xmix_reads"
READS = ("prompt_end", "last", "all", "none")
_OURS = "xmix"


def asks_for_apps(extra_args: dict | None) -> bool:
    """Whether a request says anything to xmix-lens (a key starting with "xmix")."""
    return any(str(k).startswith(_OURS) for k in (extra_args or {}))


def chosen_apps(extra_args: dict | None, installed: Sequence[str] | Mapping[str, Mapping]) -> tuple[str, ...] | None:
    """The apps a request chose, in install order; None if it says nothing to xmix-lens. `installed`:
    the app names, or {app: {param: (lowest, highest)}} with the parameters each declares for requests.
    A ValueError names what is wrong and how to write it."""
    extra = extra_args or {}
    if not asks_for_apps(extra):
        return None
    for key in extra:
        key = str(key)
        if key.startswith(f"{_OURS}.") and key.count(".") >= 2:
            continue  # a parameter: checked below, once the apps are known
        if key.startswith(_OURS) and key not in (APPS_KEY, READS_KEY):
            raise ValueError(f"vllm_xargs[{key!r}] is not an xmix-lens key; choose apps with "
                             f'{{"{APPS_KEY}": "app1,app2"}} and their reads\' positions with {READS_KEY!r}')
    reads_wanted(extra)
    value = extra.get(APPS_KEY, "")
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",")] if value.strip() else []
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
    else:
        raise ValueError(f"vllm_xargs[{APPS_KEY!r}] is {value!r}; it takes app names, comma-separated "
                         f'("app1,app2") or as a list of strings')
    if any(not n for n in names):
        raise ValueError(f"vllm_xargs[{APPS_KEY!r}] = {value!r} has an empty app name")
    if len(set(names)) != len(names):
        raise ValueError(f"vllm_xargs[{APPS_KEY!r}] = {value!r} names an app twice")
    unknown = [n for n in names if n not in installed]
    if unknown:
        raise ValueError(f"vllm_xargs[{APPS_KEY!r}]: no app named {unknown[0]!r} on this server; "
                         f"it serves {list(installed)}")
    chosen = tuple(n for n in installed if n in names)
    declared = installed if isinstance(installed, Mapping) else {}
    for key, value in extra.items():
        if not (str(key).startswith(f"{_OURS}.") and str(key).count(".") >= 2):
            continue
        app, _, param = str(key)[len(_OURS) + 1:].partition(".")
        problem = param_problem(app, param, value, chosen, declared)
        if problem is not None:
            raise ValueError(f"vllm_xargs[{key!r}] {problem}" + (f" in {APPS_KEY!r}" if app not in chosen else ""))
    return chosen


def param_problem(app: str, param: str, value, chosen: Sequence[str], declared: Mapping[str, Mapping],
                  chooser: str = "this request") -> str | None:
    """What is wrong with `chooser` (which chose the apps `chosen`) setting `app`'s request param
    `param` to `value`, as the end of a sentence naming the setting; None if nothing is.
    `declared`: {app: {param: (lowest, highest)}}."""
    if app not in chosen:
        return f"sets a parameter of {app!r}, which {chooser} does not choose"
    bounds = declared.get(app, {}).get(param)
    if bounds is None:
        return f"sets {param!r}, but app {app!r} declares no request parameter {param!r}; it declares " \
               f"{sorted(declared.get(app, {}))}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not bounds[0] <= value <= bounds[1]:
        return f"is {value!r}; it takes a number in [{bounds[0]}, {bounds[1]}]"
    return None


def chosen_values(extra_args: dict | None) -> dict[str, dict[str, float]]:
    """{app: {param: value}} a request sets (after chosen_apps has checked them)."""
    values: dict[str, dict[str, float]] = {}
    for key, value in (extra_args or {}).items():
        if str(key).startswith(f"{_OURS}.") and str(key).count(".") >= 2:
            app, _, param = str(key)[len(_OURS) + 1:].partition(".")
            values.setdefault(app, {})[param] = float(value)
    return values


def salt(extra_args: dict | None, config_digest: str, reading: Collection[str] = ()) -> str | None:
    """The prefix-cache salt of a request's choice (None: it says nothing to xmix-lens). The same
    apps, in any order or spelling, give the same salt; except that a request choosing an app of
    `reading` (apps that read) and wanting every position's reads gets a salt of its own: it
    computes every position, and its reads cover every position they promise (the prompt's last
    token and the latest one are computed on any cache hit)."""
    extra = extra_args or {}
    if not asks_for_apps(extra):
        return None
    value = extra.get(APPS_KEY, "")
    names = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [repr(value)]
    choice = sorted({str(n).strip() for n in names} - {""})
    values = sorted((app, param, v) for app, params in chosen_values(extra).items() for param, v in params.items())
    own = "xmix:" + hashlib.sha256(json.dumps([config_digest, choice, values]).encode()).hexdigest()[:32]
    if set(choice) & set(reading) and reads_wanted(extra) == "all":
        own += f":{uuid.uuid4().hex}"
    return own


def reads_wanted(extra_args: dict | None) -> str:
    """Which positions of its reads a request wants back (one of READS)."""
    value = (extra_args or {}).get(READS_KEY, READS[0])
    if value not in READS:
        raise ValueError(f"vllm_xargs[{READS_KEY!r}] is {value!r}; it takes one of {list(READS)}")
    return value
