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
"""
from dataclasses import dataclass, field

import torch

REDUCTIONS = ("mean", "sum", "max")


@dataclass(eq=False)
class StoreSpec:
    """One store of a pass: where it is written, how, and the device buffer consumers read."""

    name: str
    reduce: str | None  # None: per token; "last": the value of one selected position; or REDUCTIONS
    feature_shape: tuple[int, ...]
    buffer: torch.Tensor | None = None  # [B, P, O]: what consumers read at (row, position)
    row_buffer: torch.Tensor | None = None  # [B, 1, O]: a per-request value, for generated tokens
    per_token: torch.Tensor | None = None  # [B, P, O] the values a reduction folds
    written: torch.Tensor | None = None  # [B, P] which positions have been written

    def __repr__(self) -> str:
        return f"store({self.name!r})"


@dataclass
class TraceSession:
    """The stores of the hooks being traced: the prompt's (prefill), or the generated tokens'
    (decode), which also see the prompt's per-request stores."""

    batch: int
    padded_len: int
    stores: dict[str, StoreSpec] = field(default_factory=dict)
    inherited: dict[str, StoreSpec] = field(default_factory=dict)  # the prompt's, seen while decoding

    def find(self, name: str) -> StoreSpec | None:
        return self.stores.get(name) or self.inherited.get(name)

    def per_request(self) -> dict[str, StoreSpec]:
        return {name: spec for name, spec in self.stores.items() if spec.reduce is not None}

    def allocate(self, device) -> None:
        """Device buffers for the stores this session's hooks write."""
        for spec in self.stores.values():
            O = 1
            for s in spec.feature_shape:
                O *= s
            spec.buffer = torch.zeros(self.batch, self.padded_len, O, device=device)
            spec.row_buffer = torch.zeros(self.batch, 1, O, device=device)
            spec.per_token = torch.zeros(self.batch, self.padded_len, O, device=device)
            spec.written = torch.zeros(self.batch, self.padded_len, dtype=torch.bool, device=device)


class RequestStore:
    """The `store` object hooks use: put() in one hook, get() in a later one."""

    def put(self, name: str, value, reduce: str | None = None) -> None:
        from .trace import TracedTensor, current_tracer

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
        from .trace import current_tracer

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
