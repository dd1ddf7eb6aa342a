"""Stores: values one hook writes and a later hook reads, per request, inside the engine.

    from xmix_lens import store

    def probe(act, hook):                        # blocks.3.hook_resid_post
        store.put("harm", act @ w, reduce="mean")  # mean over the prompt's positions, per request
    def refuse(act, hook):                       # blocks.14.hook_resid_post
        return act + (store.get("harm") > 0.5)[..., None] * refusal_dir

`store.get(name)` has the layout of an activation, [batch, pos, *value features]: a per-token
value (no `reduce`) is read at the same position that wrote it; a per-request value (`reduce`
"mean", "sum" or "max" over the prompt, or `put` of one selected position such as `act[:, -1]`)
is the same at every position of the request. Values live on the device for as long as the
request does; the host never sees them unless a hook also keeps them (a read).

While generating, hooks run on each new token (act is [batch, 1, ...]): a reduction keeps the
prompt's value, so a prompt-level condition gates writes on every generated token; a per-token
store or one position's value (`act[:, -1]`) is the newest token's.

Writing a traced value into a plain dict and using it in a later hook (`ctx["s"] = act @ w`, then
`act + ctx["s"][..., None] * v`) works too: it is a per-token store.

`store` is the hooks' handle on the tracer calling them (trace.py), which keeps a pass's stores
(trace.StoreSpec, trace.TraceSession).
"""
from .trace import TracedTensor, current_tracer

REDUCTIONS = ("mean", "sum", "max")


class RequestStore:
    """The `store` object hooks use: put() in one hook, get() in a later one."""

    def put(self, name: str, value, reduce: str | None = None) -> None:
        tracer = current_tracer()
        if tracer is None or not isinstance(value, TracedTensor):
            raise RuntimeError("store.put works inside a hook while xmix-lens traces it, with a value computed "
                               "from act")
        session = tracer.session
        if reduce is not None and reduce not in REDUCTIONS:
            raise ValueError(f"reduce={reduce!r}: use one of {REDUCTIONS} or None (per token)")
        if reduce is not None and name in session.inherited:
            return  # a reduction over the prompt: generated tokens keep the prompt's value
        if name in session.stores:
            raise ValueError(f"store {name!r} is written twice in one pass; use another name")
        value._tracer.store_put(name, value, reduce, session)

    def get(self, name: str):
        tracer = current_tracer()
        if tracer is None:
            raise RuntimeError("store.get works inside a hook while xmix-lens traces it")
        session = tracer.session
        spec = session.find(name)
        if spec is None:
            raise KeyError(f"store {name!r} is read before any hook writes it (stores written so far: "
                           f"{sorted(set(session.stores) | set(session.inherited))}); put it in a hook at an "
                           f"earlier hook point")
        return tracer.store_get(spec)

    __setitem__ = put
    __getitem__ = get


store = RequestStore()
