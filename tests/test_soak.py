"""The soak tests at toy size: scripts/soak.py at 500 requests (two threads, mixed calls, NaN and
raising hooks, prefix caching on; every call equals the same call run alone on a fresh prefix
cache), and scripts/served_soak.py at 300 (clients of `xmix-lens serve`, some going away)."""
from scripts import served_soak
from scripts.soak import soak


def test_five_hundred_mixed_requests_from_two_threads(served):
    summary = soak(served["tiny-llama"], requests=500, seed=1)
    assert summary["requests"] >= 500
    assert summary["unexpected_outcomes"] == 0, summary["unexpected_calls"]
    assert summary["mismatches"] == 0, summary["mismatched_calls"]
    assert {"nan: NonFiniteError", "plain: ok", "generate: ok", "apps: ok"} <= set(summary["outcomes"])


def test_served_clients_some_going_away_leave_no_reads_held(tmp_path):
    result = served_soak.main(["--requests", "300", "--sample-every", "100", "--out", str(tmp_path / "soak.json")])
    assert set(result["outcomes"]) == {"whole", "stream", "gone"}  # every finished request got its reads
    assert sum(result["outcomes"].values()) == 300
    assert [s["reads_held"] for s in result["samples"]] == [0.0, 0.0, 0.0]
