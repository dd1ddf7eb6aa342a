"""The soak test (scripts/soak.py) at 500 requests: two threads, mixed calls, NaN and raising hooks,
prefix caching on; every call equals the same call run alone on a fresh prefix cache."""
from scripts.soak import soak


def test_five_hundred_mixed_requests_from_two_threads(served):
    summary = soak(served["tiny-llama"], requests=500, seed=1)
    assert summary["requests"] >= 500
    assert summary["unexpected_outcomes"] == 0, summary["unexpected_calls"]
    assert summary["mismatches"] == 0, summary["mismatched_calls"]
    assert {"nan: NonFiniteError", "plain: ok", "generate: ok", "apps: ok"} <= set(summary["outcomes"])
