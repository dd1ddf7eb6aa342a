"""The driver's handle on the site runtimes of an engine whose model lives in worker processes.

Under tensor or pipeline parallelism vLLM builds the model in worker processes, one per rank, and
each has its own site runtime (runtime.py) over its shard (TP) and its stage's layers (PP). The
driver (the user's process: HookedServedModel) calls the same methods it calls on an in-process
runtime ("what the driver calls" in runtime.py); here each is one collective RPC, run by every
worker in the order sent (the same queue as the engine's steps, so a call made between steps lands
between them). Each stage's first TP rank answers for its stage's hook points, and the answers are
merged. Arguments and answers are pickled: lowered ops go out with their tensors on the host,
reads come back on it.
"""
import io

import torch

from ..control import AppInfo
from ..engine import PassResults


def on_runtime(worker, path: str, args: bytes | None):
    """Run in each worker: a method of its site runtime called with the saved args (_saved), or (args None)
    an attribute read (`control.delivers`). Returns (True, result) or (False, the exception): an
    exception raised out of a collective RPC would leave the other ranks' answers unread in vLLM's
    queues, to be taken as the answers of the next call."""
    try:
        target = worker.model_runner.model.xmix_runtime
        for name in path.split("."):
            target = getattr(target, name)
        return True, target if args is None else target(*torch.load(io.BytesIO(args), weights_only=False))
    except Exception as e:  # noqa: BLE001 (sent back whole, raised in the driver)
        return False, e


def unembedding_of(worker, d_vocab: int):
    """Run in each worker: (W_U, b_U) on the host (they cross to the driver), the vocabulary gathered
    from every rank of the last pipeline stage, the one whose output layer makes the logits; None
    on other stages."""
    from vllm.distributed import get_pp_group

    from .sites import unembedding
    if not get_pp_group().is_last_rank:
        return None
    return tuple(t.cpu().contiguous() for t in unembedding(worker.model_runner.model, d_vocab))


def merge_stage_reads(answers: list[dict]) -> dict:
    """take_served_reads's answers of a pipeline's stages, as one: each stage answers every reading
    request, in the same order, with the reads at its own hook points; a request's are all stages'
    reads of each of its prompts. (Stages agree on which they answer later: None on all.)"""
    return {api_id: None if answers[0][api_id] is None else
            [(entries[0][0], [read for _, reads in entries for read in reads])
             for entries in zip(*(taken[api_id] for taken in answers))]
            for api_id in answers[0]}


def _saved(args: tuple) -> bytes:
    """The arguments as torch.save writes them: tensors that share storage (a store's buffer, which one
    op fills, and the view of it another op reads as a table) arrive sharing it. vLLM's RPC pickles,
    and pickle gives each tensor a storage of its own: the reader would read a copy nothing fills."""
    buffer = io.BytesIO()
    torch.save(args, buffer)
    return buffer.getvalue()


class RemoteRuntime:
    # stores are allocated on the driver's host and moved to each worker's device when a pass opens
    device = torch.device("cpu")

    def __init__(self, llm):
        self.llm = llm
        # app name -> AppInfo, kept in step with the workers' (from_pretrained(apps=...) installed some)
        ranks = self.read("installed")
        self.installed = {name: AppInfo.of_ranks([installed[name] for installed in ranks]) for name in ranks[0]}

    def _call(self, method: str, *args):
        return self._answers(method, args)[0]

    def _delivered(self, method: str, *args) -> list:
        """The answers of the ranks that deliver (each pipeline stage's first tensor-parallel rank,
        for the hook points of its stage; the others answer None)."""
        return [answer for answer in self._answers(method, args) if answer is not None]

    def read(self, path: str) -> list:
        """An attribute of every rank's runtime, by rank (for tests and benchmarks)."""
        return self._answers(path, None)

    def _answers(self, path: str, args: tuple | None) -> list:
        outcomes = self.llm.collective_rpc(on_runtime, args=(path, None if args is None else _saved(args)))
        for ok, value in outcomes:
            if not ok:  # every rank ran the call (and answered); the first error, as raised there
                raise value
        return [value for _, value in outcomes]

    def install_app(self, name, ops_by_hook_point, params=None):
        self.installed[name] = info = AppInfo.of_ranks(self._answers("install_app", (name, ops_by_hook_point, params)))
        return info

    def set_app_params(self, name, ops_by_hook_point):
        self.installed[name] = info = AppInfo.of_ranks(self._answers("set_app_params", (name, ops_by_hook_point)))
        return info

    def uninstall_app(self, name):
        self._call("uninstall_app", name)
        del self.installed[name]

    def set_default_apps(self, names):
        self._call("set_default_apps", tuple(names))

    def take_served_reads(self, request_ids, forget=(), wait=False):
        return merge_stage_reads(self._delivered("take_served_reads", request_ids, forget, wait))

    def clear_results(self):
        self._call("clear_results")

    def begin_passes(self, specs):
        return self._call("begin_passes", specs)

    def route(self, rows, selections):
        self._call("route", rows, selections)

    def finish_passes(self, pass_ids, req_ids):
        return [PassResults.of_stages(list(stages))
                for stages in zip(*self._delivered("finish_passes", pass_ids, req_ids))]
