"""The engine contract: what the TransformerLens API (xmix_lens/model.py, planner.py, installer.py)
and the evaluation runner ask of a serving engine, and the plain types that cross the seam.

vLLM's engine (vllm/engine.py: `VllmEngine`) is the one implementation; `from_pretrained` is
the one place that names it. A second backend (SGLang, say) implements `Engine` beside it and
reuses the engine-neutral parts here: the control plane (control.py), the read messenger
(messenger.py), tensor-parallel placement (sharding.py), the CUDA runtime calls (cudart.py) and
the executor (executor.py).
"""
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from xmix_lens.passes import PassPlan


@dataclass
class PassResults:
    """What a finished pass read: each read key's value in its traced shape (on the engine's device
    where the engine runs in this process, else on the host), and per row (by `row` order) what the
    row's installed apps read: (app, read key) -> (positions, values)."""

    values: dict[object, torch.Tensor]
    app_results: list[dict]
    nonfinite: dict[str, list[int]] = field(default_factory=dict)  # hook point -> rows whose writes there
    #                                                                  left NaN or infinite values

    def result(self, key) -> torch.Tensor:
        return self.values[key]

    @classmethod
    def of_stages(cls, stages: list["PassResults"]) -> "PassResults":
        """One pass's results from each pipeline stage, as one: each read what its hook points hold."""
        return cls({key: value for stage in stages for key, value in stage.values.items()},
                   [{key: value for stage in rows for key, value in stage.items()}
                    for rows in zip(*(stage.app_results for stage in stages))],
                   {point: rows for stage in stages for point, rows in stage.nonfinite.items()})


@dataclass
class PassOutcome:
    """One finished pass: what it read and each row's new tokens."""

    results: PassResults
    tokens: list[list[int]]


@dataclass
class ServedRequest:
    """A request as a server takes it: its prompt's token ids, vLLM's SamplingParams fields, and its
    `vllm_xargs`, which choose its apps and their param values (xmix_lens/request_choice.py)."""

    key: str  # unique among the requests in flight, without "-" (vLLM appends "-" and a suffix)
    prompt: list[int]
    sampling: dict
    xargs: dict | None = None
    reads: bool = False  # whether its chosen apps read (their reads are fetched when it finishes)


@dataclass
class ServedResult:
    key: str
    prompt_tokens: int
    tokens: list[int]
    finish_reason: str | None
    prompt_logprobs: list[float] | None  # of each prompt token after the first, if asked for
    reads: list  # the apps' reads: [(prompt index, [(app, read key, positions, values)])] (see reads_json)


class Engine(Protocol):
    """A serving engine with the site runtime in it, as the API uses it."""

    device: torch.device  # where the model's activations live
    max_model_len: int  # the most positions a request may take
    max_num_seqs: int  # the most requests a step runs
    installed: dict  # name -> control.AppInfo of every app resident in the engine
    last_run_stats: dict  # requests, prompt tokens and prefix-cache hits of the last `run`
    W_U: torch.Tensor  # the unembedding the engine serves (for `unembed`)

    def run(self, plans: list[PassPlan], progress: str | None = None) -> list[PassOutcome]:
        """Run the passes together, each pass's ops on its own rows only."""

    def serve(self, requests: Iterable[ServedRequest], in_flight: int) -> Iterator[ServedResult]:
        """Requests as a server serves them (apps chosen per request), each yielded as it finishes."""

    def unembed(self, normalized: torch.Tensor, next_tokens: torch.Tensor | None = None,
                logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [B, P, d_vocab] and next-token NLL [B, P - 1] from a read of unembed.hook_in."""

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's own weights under the Hugging Face checkpoint's names, without a copy (views in
        the engine's layout: a linear layer's [out, in]; vocabulary rows may be padded); those it
        does not keep in that form are absent."""

    def why_not_resident(self, name: str, ops_by_hook_point: dict) -> str | None:
        """Why an app's lowered ops cannot be resident (they are not per token), or None."""

    def install_app(self, name: str, ops_by_hook_point: dict, params: dict | None = None):
        """Make an app's lowered ops resident; `params`: {name: (default, lowest, highest)}."""

    def set_app_params(self, name: str, ops_by_hook_point: dict):
        """Copy a resident app's new tensors into the engine's in place."""

    def uninstall_app(self, name: str) -> None: ...

    def shutdown(self) -> None:
        """Stop the engine's workers now; other engines in this process keep running."""


def reads_json(per_prompt: list, outputs: dict, max_values: int) -> list[dict]:
    """[(prompt index, [(app, read key, positions, values: float32 bytes)])] as JSON: per prompt, app and output,
    {"positions": [...], "values": [...] (each of the output's feature shape), "left_out": n}, the
    latest positions that fit in `max_values` numbers over the whole response."""
    out, budget = [], max_values
    for index, reads in sorted(per_prompt, key=lambda item: item[0]):
        apps = {}
        for app, key, positions, values in reads:
            output, shape, _ = outputs[(app, tuple(key))]  # a ResidentRead
            width = math.prod(shape)
            kept = min(len(positions), budget // max(width, 1))
            budget -= kept * width
            values = np.frombuffer(values, dtype=np.float32).reshape(len(positions), width)
            apps.setdefault(app, {})[output] = {
                "positions": positions[len(positions) - kept:] if kept else [],
                "values": values[len(values) - kept:].reshape(kept, *shape).tolist(), "left_out": len(positions) - kept}
        out.append({"index": index, "apps": apps})
    return out
