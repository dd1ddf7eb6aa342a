"""`xmix-lens plot` (xmix_lens/evaluation.py: sweep_curves, plot): one curve per value of a record
field (`--by target`), each with its baseline without apps, on a small hand-written results file.

The expected means and standard errors are computed here with plain Python from the records; no
engine is needed (plot reads a results file only)."""
import json
import math
import subprocess
import sys

import pytest

from xmix_lens.evaluation import plot, sweep_curve, sweep_curves

SCALES = [0.0, 4.0, 8.0]
PROMPTS = ["Today I feel", "After hearing the news, I was", "The children at the party were"]
TARGETS = [" happy", " sad"]


def score_record(line, prompt_i, target, scale):
    """A scored row's record as eval writes it: steering raises " happy" and lowers " sad"; the
    same row without apps does not change with the scale."""
    sign = 1.0 if target == " happy" else -1.0
    base = -5.0 - 0.5 * prompt_i - (2.0 if target == " sad" else 0.0)
    logprob = base + sign * 0.1 * scale * (1 + prompt_i)
    return {"id": f"score-{prompt_i}{target}", "line": line, "sweep": {"joy.scale": scale}, "apps": ["joy"],
            "params": {"joy.scale": scale}, "target": target, "target_token_ids": [100 + len(target)],
            "logprob": logprob, "loss": -logprob, "token_logprobs": [logprob],
            "without_apps": {"logprob": base, "loss": -base, "token_logprobs": [base]}, "reads": {}}


@pytest.fixture
def results(tmp_path):
    records, line = [], 0
    for scale in SCALES:
        for i, prompt in enumerate(PROMPTS):
            for target in TARGETS:
                line += 1
                records.append(score_record(line, i, target, scale))
        line += 1  # a generated row: a read, no score
        records.append({"id": "gen-0", "line": line, "sweep": {"joy.scale": scale}, "apps": ["joy", "probe"],
                        "params": {"joy.scale": scale}, "prompt_tokens": 4, "completion": " good", "token_ids": [1],
                        "finish_reason": "length",
                        "reads": {"probe": {"score": {"positions": [3], "values": [scale - 10.0], "left_out": 0}}}})
    records.append({"id": "bad", "line": line + 1, "error": "no app named 'nope'"})  # skipped by the plot
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path, records


def mean_and_se(values):
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def expected(records, key, y, group):
    """{scale: (mean, se, n)} of record[key-path y] over the scored records whose target is `group`."""
    out = {}
    for scale in SCALES:
        values = [y(r) for r in records if "error" not in r and "logprob" in r and r["sweep"]["joy.scale"] == scale
                  and (group is None or r[key] == group)]
        out[scale] = (*mean_and_se(values), len(values))
    return out


@pytest.mark.parametrize("y", ["logprob", "loss"])
def test_by_target_gives_one_curve_per_target_with_its_baseline(results, y):
    path, records = results
    curves = sweep_curves(path, "joy.scale", y, by="target")
    assert [c.value for c in curves] == TARGETS  # in the order the file gives them
    assert [c.label for c in curves] == ["target=' happy'", "target=' sad'"]
    for curve in curves:
        want = expected(records, "target", lambda r: r[y], curve.value)
        want_base = expected(records, "target", lambda r: r["without_apps"][y], curve.value)
        assert [p[0] for p in curve.points] == SCALES and [p[0] for p in curve.baseline] == SCALES
        for (scale, mean, se, n), (bscale, bmean, bse, bn) in zip(curve.points, curve.baseline):
            assert (mean, se, n) == pytest.approx(want[scale]) and n == len(PROMPTS)
            assert (bmean, bse, bn) == pytest.approx(want_base[scale])
    happy, sad = (c.points for c in curves)
    sign = 1 if y == "logprob" else -1
    assert sign * (happy[-1][1] - happy[0][1]) > 0 > sign * (sad[-1][1] - sad[0][1])  # the effect, per target
    # without --by the two targets average into one curve (the flat line the issue was about)
    (whole,) = sweep_curves(path, "joy.scale", y)
    assert whole.value is None and whole.label == "all rows"
    want = expected(records, "target", lambda r: r[y], None)
    assert [v for p in whole.points for v in p[1:]] == pytest.approx([v for s in SCALES for v in want[s]])
    assert len({round(p[1], 9) for p in whole.points}) == 1  # flat: these targets' effects cancel in the mean
    assert sweep_curve(path, "joy.scale", y) == whole.points


def test_reads_have_no_baseline_and_group_by_other_fields(results):
    path, records = results
    (curve,) = sweep_curves(path, "joy.scale", "reads.probe.score", by="id")
    assert curve.value == "gen-0" and curve.baseline == []
    assert [(p[0], p[1], p[3]) for p in curve.points] == [(s, s - 10.0, 1) for s in SCALES]
    # a dotted path into a record, and grouping by the swept value itself (one point per curve)
    by_prompt = sweep_curves(path, "joy.scale", "logprob", by="id")
    assert len(by_prompt) == len(PROMPTS) * len(TARGETS)
    assert sweep_curves(path, "joy.scale", "without_apps.logprob", by="target")[0].baseline == []
    by_param = sweep_curves(path, "joy.scale", "logprob", by="params.joy.scale")
    assert [c.value for c in by_param] == SCALES and all(len(c.points) == 1 for c in by_param)


def test_by_target_falls_back_to_target_token_ids(tmp_path, results):
    """Records written before records held their target string group by its tokens."""
    path, records = results
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "target"}) + "\n" for r in records))
    curves = sweep_curves(old, "joy.scale", "logprob", by="target")
    assert [c.value for c in curves] == [[106], [104]]
    assert [c.points for c in curves] == [c.points for c in sweep_curves(path, "joy.scale", "logprob", by="target")]


def test_plot_writes_a_png_by_target_and_from_the_command_line(results, tmp_path):
    path, _ = results
    out = plot(path, "joy.scale", "logprob", tmp_path / "by_target.png", by="target")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = subprocess.run([sys.executable, "-m", "xmix_lens.cli", "plot", str(path), "--x", "joy.scale", "--y",
                           "logprob", "--by", "target", "--out", str(tmp_path / "cli.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "cli.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-m", "xmix_lens.cli", "plot", str(path), "--x", "sad.scale", "--y",
                              "logprob", "--by", "target", "--out", str(tmp_path / "none.png")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "no swept 'sad.scale'" in missing.stderr
