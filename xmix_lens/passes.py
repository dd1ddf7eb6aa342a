"""Pass plans: what the front end hands a backend for one engine pass.

A call (`run_with_hooks`, `generate`, a row group of a call with apps) becomes one `PassPlan`:
the rows' real tokens and where they sit in TransformerLens's padded layout, the lowered ops of
each phase (the prompt's, and the generated tokens'), sampling, and each row's installed apps.
Plans are plain data built by plain calls and by calls with apps alike; the backend runs a list
of them together (backend/vllm/engine.py).
"""
from dataclasses import dataclass, field

from .lowered import LoweredOp


@dataclass
class PhaseOps:
    """The hooks of one phase of a pass (the prompt, or each generated token), traced and lowered."""

    padded_len: int
    ops: dict[str, list[LoweredOp]]  # hook point -> lowered ops, in hook order
    kept: list  # (read key, proxy): proxies the hook functions kept, swapped for values after the pass
    graphs: list  # the traced ir.Graphs, for explain()
    per_request_stores: dict  # the prompt's stores reduced per request, seen by generated tokens


@dataclass
class PassPlan:
    rows: list[list[int]]  # each row's real tokens
    places: list  # per row, int64 [n]: each real token's position in the padded layout (planner.Rows)
    prompt: PhaseOps
    decode: PhaseOps | None = None  # ops on generated tokens (generate), else None
    max_new_tokens: int = 1  # a forward pass samples one token, which nobody reads
    sampling: dict = field(default_factory=dict)  # vLLM SamplingParams fields
    apps: list[tuple[str, ...]] | None = None  # per row: the installed apps it selects
    call_rows: list[int] | None = None  # each row's index in the call's input (None: the same)
    contexts: list[int] | None = None  # per row, its first tokens no hook sees (a KV cache's past; None: 0)
