"""The driver's handle on the site runtimes of a tensor-parallel engine.

Under TP vLLM builds the model in worker processes, one per rank, and each has its own site
runtime (runtime.py) over its shard. The driver (the user's process: HookedServedModel) calls
the same methods it calls on an in-process runtime ("what the driver calls" in runtime.py); here
each is one collective RPC, run by every worker in the order sent (the same queue as the engine's
steps, so a call made between steps lands between them), and rank 0 answers. Arguments and
answers are pickled: lowered ops go out with their tensors on the host, reads come back on it.
"""
import torch


def on_runtime(worker, path: str, args: tuple | None):
    """Run in each worker: a method of its site runtime called with args, or (args None) an
    attribute read (`control.delivers`). Returns (True, result) or (False, the exception): an
    exception raised out of a collective RPC would leave the other ranks' answers unread in vLLM's
    queues, to be taken as the answers of the next call."""
    try:
        target = worker.model_runner.model.xmix_runtime
        for name in path.split("."):
            target = getattr(target, name)
        return True, target if args is None else target(*args)
    except Exception as e:  # noqa: BLE001 (sent back whole, raised in the driver)
        return False, e


def unembedding_of(worker, d_vocab: int):
    """Run in each worker: (W_U, b_U) on the host (they cross to the driver), the vocabulary gathered
    from every rank."""
    from .sites import unembedding
    return tuple(t.cpu().contiguous() for t in unembedding(worker.model_runner.model, d_vocab))


class RemoteRuntime:
    # stores are allocated on the driver's host and moved to each worker's device when a pass opens
    device = torch.device("cpu")

    def __init__(self, llm):
        self.llm = llm
        # app name -> AppInfo, kept in step with the workers' (from_pretrained(apps=...) installed some)
        self.installed = self.read("installed")[0]

    def _call(self, method: str, *args):
        return self._answers(method, args)[0]

    def read(self, path: str) -> list:
        """An attribute of every rank's runtime, by rank (for tests and benchmarks)."""
        return self._answers(path, None)

    def _answers(self, path: str, args: tuple | None) -> list:
        outcomes = self.llm.collective_rpc(on_runtime, args=(path, args))
        for ok, value in outcomes:
            if not ok:  # every rank ran the call (and answered); the first error, as raised there
                raise value
        return [value for _, value in outcomes]

    def install_app(self, name, ops_by_hook_point, params=None):
        self.installed[name] = info = self._call("install_app", name, ops_by_hook_point, params)
        return info

    def set_app_params(self, name, ops_by_hook_point):
        self.installed[name] = info = self._call("set_app_params", name, ops_by_hook_point)
        return info

    def uninstall_app(self, name):
        self._call("uninstall_app", name)
        del self.installed[name]

    def set_default_apps(self, names):
        self._call("set_default_apps", tuple(names))

    def take_served_reads(self, request_ids, forget=(), wait=False):
        return self._call("take_served_reads", request_ids, forget, wait)

    def clear_results(self):
        self._call("clear_results")

    def begin_passes(self, specs):
        return self._call("begin_passes", specs)

    def route(self, rows, selections):
        self._call("route", rows, selections)

    def finish_passes(self, pass_ids, req_ids):
        return self._call("finish_passes", pass_ids, req_ids)
