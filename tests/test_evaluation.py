"""`xmix-lens eval` / `xmix_lens.evaluate` (xmix_lens/evaluation.py): rows of a JSONL file through an
engine serving an app config, each row with its own apps and param values.

Each record is checked against the in-process facade on the same weights: generated tokens and
reads against `generate(..., apps=...)` with the apps' params set to the row's values, scores
against `run_with_hooks(..., return_type="loss", loss_per_token=True)`. A real `xmix-lens eval`
subprocess is interrupted (SIGINT, then SIGKILL) and resumed; memory is measured over 500 and
5,000 rows."""
import ctypes
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.test_app_config import installed, make_apps
from tests.tiny_models import tiny_llama
from xmix_lens import HookedServedModel, evaluate
from xmix_lens.evaluation import Sweep, sweep_curve
from xmix_lens.model import own_process_environment

PROMPTS = ["Hello World! How are you", "The capital of France is", "I feel", "Once upon a time there was"]


@pytest.fixture(scope="module")
def config(served, tmp_path_factory):
    model = served["tiny-llama"]
    return model.export(make_apps(model.cfg.d_model), tmp_path_factory.mktemp("eval") / "apps")


@pytest.fixture(scope="module")
def engine(config):
    """An engine serving the config, compiled as users get it."""
    model = HookedServedModel.from_pretrained(str(tiny_llama()), max_model_len=256, config=str(config))
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def facade(served):
    """The session's engine with the same apps installed from Python: what each row must give."""
    model = served["tiny-llama"]
    with installed(model, make_apps(model.cfg.d_model)):
        yield model


class params_set:
    """The facade's apps with these param values ({"app.param": value}) for a block."""

    def __init__(self, model, values: dict):
        self.model, self.values = model, values

    def __enter__(self):
        for key, value in self.values.items():
            app, _, param = key.partition(".")
            self.model.set_params(app, **{param: value})

    def __exit__(self, *exc):
        for key in self.values:
            app, _, param = key.partition(".")
            self.model.set_params(app, **{param: 1.0})  # make_apps' defaults


def run(model, rows, path, **kwargs) -> dict:
    evaluate(model, rows, path, progress=False, **kwargs)
    records = [json.loads(line) for line in open(path)]
    return {(r["id"], json.dumps(r.get("sweep", {}), sort_keys=True)): r for r in records}


def facade_generate(model, prompt: str, apps, max_new_tokens: int):
    ids = model.to_tokens(prompt)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, apps=list(apps) or None)
    tokens = (out.result if apps else out)[0, ids.shape[1]:].tolist()
    return tokens, out, ids.shape[1]


def test_generation_rows_equal_generate_with_their_apps(engine, facade, tmp_path):
    rows = [{"id": "plain", "prompt": PROMPTS[0], "max_new_tokens": 6},
            {"id": "steer", "prompt": PROMPTS[1], "apps": ["steer"], "max_new_tokens": 6},
            {"id": "steer-2.5", "prompt": PROMPTS[1], "apps": "steer,probe", "params": {"steer.coef": -2.5}},
            {"id": 7, "prompt": PROMPTS[2], "apps": ["probe", "gate"], "params": {"gate.gain": 3.0}, "reads": "last"},
            {"id": "all", "prompt": PROMPTS[3], "apps": ["steer", "probe", "gate"], "max_new_tokens": 4}]
    records = run(engine, rows, tmp_path / "out.jsonl", max_new_tokens=5)
    assert len(records) == len(rows)
    for row in rows:
        record = records[(row["id"], "{}")]
        names = row.get("apps", [])
        names = names.split(",") if isinstance(names, str) else names
        n = row.get("max_new_tokens", 5)
        with params_set(facade, row.get("params", {})):
            tokens, out, P = facade_generate(facade, row["prompt"], names, n)
        assert record["token_ids"] == tokens, row["id"]
        assert record["completion"] == facade.tokenizer.decode(tokens, skip_special_tokens=True)
        assert record["prompt_tokens"] == P and record["apps"] == [a for a in ["steer", "probe", "gate"] if a in names]
        if "probe" in names:  # the probe's score at the prompt's end (default), or at the latest token run
            read = record["reads"]["probe"]["score"]
            if row.get("reads") == "last":
                expected, position = out.generated_outputs["probe"]["score"][0], P + n - 2
            else:
                expected, position = out.outputs["probe"]["score"][0, -1], P - 1
            assert read["positions"] == [position]
            torch.testing.assert_close(torch.tensor(read["values"][0]).reshape(-1), expected.float().reshape(-1),
                                       rtol=1e-4, atol=1e-4)
        else:
            assert record["reads"] == {}
    # the apps ran: steering changes the tokens
    assert records[("steer", "{}")]["token_ids"][:5] != facade_generate(facade, PROMPTS[1], [], 5)[0]


def test_scoring_rows_equal_the_loss_of_run_with_hooks(engine, facade, tmp_path):
    rows = [{"id": "a", "prompt": PROMPTS[1], "target": " Paris, of course"},
            {"id": "b", "prompt": PROMPTS[0], "target": " fine thanks", "apps": ["steer", "gate"],
             "params": {"steer.coef": 2.0}}]
    records = run(engine, rows, tmp_path / "scores.jsonl")
    for row in rows:
        record = records[(row["id"], "{}")]
        prompt = facade.to_tokens(row["prompt"])[0].tolist()
        target = facade.tokenizer(row["target"], add_special_tokens=False)["input_ids"]
        assert record["target"] == row["target"] and record["target_token_ids"] == target  # (plot --by target)
        tokens = torch.tensor([prompt + target])
        names = row.get("apps")
        with params_set(facade, row.get("params", {})):
            out = facade.run_with_hooks(tokens, return_type="loss", loss_per_token=True, apps=names)
        per_token = (out.result if names else out)[0, -len(target):]
        torch.testing.assert_close(-torch.tensor(record["token_logprobs"]), per_token.float(), rtol=1e-4, atol=1e-4)
        assert record["loss"] == pytest.approx(float(per_token.mean()), rel=1e-4, abs=1e-4)
        assert record["logprob"] == pytest.approx(-float(per_token.sum()), rel=1e-4, abs=1e-4)
        if names:  # and without its apps
            plain = facade.run_with_hooks(tokens, return_type="loss", loss_per_token=True)[0, -len(target):]
            assert record["without_apps"]["loss"] == pytest.approx(float(plain.mean()), rel=1e-4, abs=1e-4)
            assert abs(record["loss"] - record["without_apps"]["loss"]) > 1e-3  # the apps changed the score
        else:
            assert "without_apps" not in record


def test_sweep_runs_every_row_at_every_value_and_plots_its_curve(engine, facade, tmp_path):
    rows = [{"id": i, "prompt": p, "apps": ["probe"], "max_new_tokens": 3} for i, p in enumerate(PROMPTS)]
    records = run(engine, rows, tmp_path / "sweep.jsonl", sweep=["steer.coef=-2,0,3"])
    assert len(records) == len(rows) * 3
    for (row_id, point), record in records.items():
        value = json.loads(point)["steer.coef"]
        assert record["apps"] == ["steer", "probe"] and record["params"] == {"steer.coef": value}
        with params_set(facade, {"steer.coef": value}):
            tokens, out, _ = facade_generate(facade, PROMPTS[row_id], ["steer", "probe"], 3)
        assert record["token_ids"] == tokens
        torch.testing.assert_close(torch.tensor(record["reads"]["probe"]["score"]["values"][0]).reshape(-1),
                                   out.outputs["probe"]["score"][0, -1].float().reshape(-1), rtol=1e-4, atol=1e-4)
    curve = sweep_curve(tmp_path / "sweep.jsonl", "steer.coef", "reads.probe.score")
    assert [c[0] for c in curve] == [-2.0, 0.0, 3.0] and all(c[3] == len(rows) for c in curve)
    for value, mean, _, _ in curve:
        scores = [r["reads"]["probe"]["score"]["values"][0] for (_, p), r in records.items()
                  if json.loads(p)["steer.coef"] == value]
        assert mean == pytest.approx(sum(scores) / len(scores))
    with pytest.raises(ValueError, match="reads.APP.OUTPUT"):
        sweep_curve(tmp_path / "sweep.jsonl", "steer.coef", "reads.probe")


def test_bad_rows_become_error_records_and_the_rest_run(engine, tmp_path):
    good = [{"id": "g1", "prompt": PROMPTS[0], "apps": ["steer"], "max_new_tokens": 3},
            {"id": "g2", "prompt": PROMPTS[1], "target": " Paris"}]
    bad = {  # line's text -> what its error says
        '{"id": "b1", "prompt": "x", "apps": ["nope"]}': "no app named 'nope'",
        '{"id": "b2", "prompt": "x", "temprature": 0.5}': "unknown field 'temprature'",
        '{"id": "b3", "prompt": "x", "apps": ["steer"], "params": {"steer.coef": 99}}': r"in \[-4.0, 4.0\]",
        '{"id": "b4", "prompt": "x", "params": {"steer.coef": 1}}': "which the row .* does not choose",
        '{"id": "b5", "prompt": "x", "apps": ["probe"], "params": {"probe.w": 1}}': "declares no request parameter",
        '{"prompt": "no id"}': 'needs an "id"',
        '{"id": "b7", "prompt": "x", "messages": []}': "exactly one",
        '{"id": "b8", "prompt": "x", "max_new_tokens": 0}': "max_new_tokens",
        '{"id": "b9", "prompt": "x", "target": " y", "max_new_tokens": 3}': "generates nothing",
        '{"id": "b10", "prompt": "x", "max_new_tokens": 300}': "max_model_len is 256",
        '{"id": "g1", "prompt": "duplicate"}': "was used by line 1",
        '{"id": "b12", "prompt": "x", "reads": "everything"}': "reads 'everything'",
        '{"id": "b13", "prompt": "x", "top_p": 2}': "top_p",
        'not json at all': "is not JSON",
        '[1, 2]': "a JSON object",
    }
    lines = [json.dumps(good[0])] + list(bad) + [json.dumps(good[1])]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    summary = evaluate(engine, tmp_path / "rows.jsonl", tmp_path / "out.jsonl", progress=False)
    records = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert summary.records == len(lines) and summary.errors == len(bad) and summary.rows == len(lines)
    by_line = {r["line"]: r for r in records}
    for line, expected in enumerate(bad.values(), start=2):
        assert "error" in by_line[line], by_line[line]
        assert re.search(expected, by_line[line]["error"]), (expected, by_line[line]["error"])
    alone = run(engine, good, tmp_path / "good.jsonl")
    for record in records:
        if "error" not in record:
            twin = alone[(record["id"], "{}")]
            assert {k: v for k, v in record.items() if k != "line"} == {k: v for k, v in twin.items() if k != "line"}


def test_bad_runs_are_refused_before_any_row(engine, config, tmp_path):
    rows = [{"id": 1, "prompt": "x"}]
    for sweep, expected in [("nope.coef=1", "no app named 'nope'"), ("probe.coef=1", "declares no request parameter"),
                            ("steer.coef=9", "outside its bounds"), ("steer.coef", "app.param=value"),
                            ("steer.coef=a,b", "app.param=value")]:
        with pytest.raises(ValueError, match=expected):
            evaluate(engine, rows, tmp_path / "never.jsonl", sweep=[sweep], progress=False)
    with pytest.raises(ValueError, match="twice"):
        evaluate(engine, rows, tmp_path / "never.jsonl", sweep=["steer.coef=1", "steer.coef=2"], progress=False)
    assert not (tmp_path / "never.jsonl").exists()
    (tmp_path / "kept.jsonl").write_text('{"id": 0}\n')
    with pytest.raises(FileExistsError, match="resume"):
        evaluate(engine, rows, tmp_path / "kept.jsonl", progress=False)
    assert (tmp_path / "kept.jsonl").read_text() == '{"id": 0}\n'
    assert Sweep.parse("joy.scale=0,1.5") == Sweep("joy", "scale", [0.0, 1.5])
    # data parallelism builds engines of its own: refused with a built model, checked before any starts
    with pytest.raises(ValueError, match="builds 2 engines"):
        evaluate(engine, rows, tmp_path / "never.jsonl", progress=False, data_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        evaluate(str(tiny_llama()), rows, tmp_path / "never.jsonl", progress=False, data_parallel_size=0)
    for given, expected in [(str(config), "no app named 'nope'"), (None, "needs an app config")]:
        with pytest.raises(ValueError, match=expected):
            evaluate(str(tiny_llama()), rows, tmp_path / "never.jsonl", sweep=["nope.coef=1"], progress=False,
                     data_parallel_size=2, config=given)
    assert not (tmp_path / "never.jsonl").exists()


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "xmix_lens.cli", *map(str, args)]


def cli_environment() -> dict:
    # the in-process settings are set by from_pretrained in the subprocess itself
    return own_process_environment()


def wait_for_records(path, at_least: int, process, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        if path.exists() and path.read_text().count("\n") >= at_least:
            return
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {at_least} records in {timeout} s")


def test_data_parallel_engines_get_devices_of_their_own(monkeypatch):
    """Each engine's environment: on the CPU its share of the cores (vLLM's per-TP-rank lists), on
    GPUs its own tensor × pipeline parallel size of them; too few GPUs refused before any engine starts."""
    from xmix_lens.evaluation import EngineRecipe

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bind = "VLLM_CPU_OMP_THREADS_BIND"
    assert EngineRecipe("m", None, {}).ranks(2) == [{bind: "0,1"}, {bind: "2,3"}]
    assert EngineRecipe("m", None, {"tensor_parallel_size": 2}).ranks(2) == [{bind: "0|1"}, {bind: "2|3"}]
    assert EngineRecipe("m", None, {}).ranks(5) == [{}] * 5  # fewer cores than engines: shared
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert EngineRecipe("m", None, {"tensor_parallel_size": 2}).ranks(2) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert EngineRecipe("m", None, {"pipeline_parallel_size": 2}).ranks(2) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert EngineRecipe("m", None, {}).ranks(2) == [{"CUDA_VISIBLE_DEVICES": "5"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    with pytest.raises(ValueError, match="need 4 GPUs; 2 are visible"):
        EngineRecipe("m", None, {"tensor_parallel_size": 2}).ranks(2)


def test_interrupted_runs_resume_to_the_uninterrupted_result(config, tmp_path):
    """A real `xmix-lens eval` process stopped by SIGINT (Ctrl-C) and later by SIGKILL, resumed each
    time, the last time over two data-parallel engines (`--data-parallel-size 2`, each in a process
    of its own on its own core): every record once, equal to an uninterrupted run of the same command
    on one engine (eager engines, as the command asks: against the compiled engine, whose rounding
    differs, one token of 115,200 differed once, likely a greedy near-tie)."""
    rows = [{"id": f"r{i}", "prompt": f"{PROMPTS[i % 4]} {i}", "apps": [["steer"], ["probe"], []][i % 3],
             "max_new_tokens": 32} for i in range(600)]  # long enough that no run ends before its signal
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    command = cli("eval", "--model", tiny_llama(), "--config", config, "--input", tmp_path / "rows.jsonl",
                  "--output", out, "--eager", "--no-progress", "--max-model-len", 256, "--sweep", "gate.gain=0,2")
    first = subprocess.Popen(command, env=cli_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_records(out, 50, first)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 130 and "continue with --resume" in err, err[-3000:]
    after_first = out.read_text().count("\n")
    assert 50 <= after_first < 1200
    second = subprocess.Popen(command + ["--resume"], env=cli_environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    wait_for_records(out, after_first + 100, second)
    second.send_signal(signal.SIGKILL)
    second.communicate(timeout=60)
    with open(out, "a") as f:  # as if the kill had cut a record short
        f.write('{"id": "r1", "line": 2, "sweep": {"gate.ga')
    third = subprocess.run(command + ["--resume", "--data-parallel-size", "2"], env=cli_environment(),
                           capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "already in" in third.stdout
    per_engine = re.search(r"over 2 engines \((\d+)/(\d+) records\)", third.stdout)
    assert per_engine and all(int(n) > 0 for n in per_engine.groups()), third.stdout  # both engines served rows
    records = [json.loads(line) for line in out.read_text().splitlines()]
    keys = [(r["id"], r["sweep"]["gate.gain"]) for r in records]
    assert len(keys) == len(set(keys)) == 1200 and not any("error" in r for r in records)
    whole_path = tmp_path / "whole.jsonl"
    whole_command = [str(whole_path) if part == str(out) else part for part in command]
    uninterrupted = subprocess.run(whole_command, env=cli_environment(), capture_output=True, text=True, timeout=600)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    whole = {(r["id"], json.dumps(r["sweep"], sort_keys=True)): r
             for r in map(json.loads, whole_path.read_text().splitlines())}
    for r in records:
        twin = whole[(r["id"], json.dumps(r["sweep"], sort_keys=True))]
        assert r["token_ids"] == twin["token_ids"], r["id"]
        assert r.get("reads", {}).keys() == twin.get("reads", {}).keys()


def test_cli_with_apps_from_python_and_the_plot(tmp_path):
    """`xmix-lens eval --apps file.py:build --sweep`, then `xmix-lens plot`, as a user runs them."""
    (tmp_path / "my_apps.py").write_text(
        "from tests.test_app_config import make_apps\n"
        "def build(model):\n    return make_apps(model.cfg.d_model)\n")
    (tmp_path / "rows.jsonl").write_text("".join(
        json.dumps({"id": i, "prompt": p, "apps": ["probe"], "max_new_tokens": 2}) + "\n" for i, p in enumerate(PROMPTS)))
    env = {**cli_environment(), "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cli("eval", "--model", tiny_llama(), "--apps", tmp_path / "my_apps.py:build", "--input",
                              tmp_path / "rows.jsonl", "--output", tmp_path / "out.jsonl", "--eager",
                              "--max-model-len", 256, "--sweep", "steer.coef=0,2,4"),
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "12 records (0 errors) from 4 rows" in done.stdout
    assert "eval: 100%" in done.stderr  # the progress bar
    # one engine: the apps are built on it and installed from their export (StartupProgress's line)
    assert done.stderr.count("vLLM ready for") == 1, done.stderr[-3000:]
    plotted = subprocess.run(cli("plot", tmp_path / "out.jsonl", "--x", "steer.coef", "--y", "reads.probe.score",
                                 "--out", tmp_path / "curve.png"), env=env, capture_output=True, text=True, timeout=120)
    assert plotted.returncode == 0, plotted.stderr[-3000:]
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    refused = subprocess.run(cli("eval", "--model", tiny_llama(), "--apps", tmp_path / "my_apps.py:build", "--input",
                                 tmp_path / "rows.jsonl", "--output", tmp_path / "out.jsonl"),
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "pass --resume" in refused.stderr


def rss_bytes() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_memory_stays_flat_with_the_number_of_rows(engine, tmp_path):
    """RSS after 5,000 rows (reads kept in every record) within a bound of RSS after 500: no row's
    state outlives its record."""
    def rows(n):
        return ({"id": i, "prompt": PROMPTS[i % 4], "apps": ["probe", "steer"], "max_new_tokens": 1} for i in range(n))

    run(engine, rows(500), tmp_path / "warm.jsonl")  # every step shape seen once
    at_500 = rss_bytes()
    summary = evaluate(engine, rows(5000), tmp_path / "long.jsonl", progress=False)
    at_5000 = rss_bytes()
    assert summary.records == 5000 and summary.errors == 0
    # a leak of 4 KiB per row would add 18 MiB
    assert at_5000 - at_500 < 16 * 2**20, (at_500, at_5000)
