"""Quiet by default (xmix_lens/verbosity.py): a script that builds a model and generates prints its
own results, a line while the engine starts, and no vLLM INFO line, non-actionable warning or Triton
exit message; XMIX_LENS_VERBOSITY=info brings vLLM's logging back; generate(verbose=True) shows a bar."""
import logging
import subprocess
import sys

import pytest

from tests.tiny_models import tiny_llama
from xmix_lens import set_verbosity
from xmix_lens.model import own_process_environment

SCRIPT = """
from xmix_lens import HookedTransformer
model = HookedTransformer.from_pretrained({path!r}, enforce_eager=True, max_model_len=128)
print("RESULT", model.generate("Hello", max_new_tokens=3, do_sample=False))
"""


def run_script(**env) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(path=str(tiny_llama()))], capture_output=True,
                          text=True, timeout=300, env={**own_process_environment(), **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_script_prints_its_results_and_not_the_engine():
    done = run_script()
    assert "RESULT" in done.stdout
    assert "vLLM ready for" in done.stderr  # the start-up line
    for noise in ("INFO ", "nanobind: leaked", "Chat template warmup failed", "Passing raw prompts", "NUMA binding",
                  "Loading safetensors checkpoint shards"):
        assert noise not in done.stdout + done.stderr, noise


def test_info_brings_back_vllm_logging_and_the_exit_messages():
    done = run_script(XMIX_LENS_VERBOSITY="info")
    assert "INFO " in done.stdout + done.stderr and "RESULT" in done.stdout
    assert "vLLM ready for" not in done.stderr  # vLLM's own lines say what happens


def test_non_actionable_warnings_are_dropped_only_when_quiet():
    from xmix_lens.backend.vllm import logs

    def passes(message: str) -> bool:
        record = logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, message, None, None)
        return all(f.filter(record) for h in logging.getLogger("vllm").handlers for f in h.filters)

    try:
        set_verbosity("quiet")
        assert not passes(logs.NOT_ACTIONABLE[0] + " and more")
        assert passes("a hook wrote NaN")  # what a user can act on stays
        set_verbosity("info")
        assert passes(logs.NOT_ACTIONABLE[0] + " and more")
    finally:
        set_verbosity("quiet")
    with pytest.raises(ValueError, match="quiet"):
        set_verbosity("loud")


def test_generate_verbose_shows_a_progress_bar(served, capfd):
    model = served["tiny-llama"]
    model.generate(["Hello", "Hi there"], max_new_tokens=2, do_sample=False)
    assert "generate" not in capfd.readouterr().err
    model.generate(["Hello", "Hi there"], max_new_tokens=2, do_sample=False, verbose=True)
    assert "generate: 100%" in capfd.readouterr().err


def test_native_start_up_noise_is_dropped_and_the_rest_kept(capfd):
    """What native code writes to fd 2 while a CPU engine starts: the non-actionable lines go, the
    rest comes back after the start (all of it if the start fails)."""
    import os

    from xmix_lens.verbosity import NATIVE_NOT_ACTIONABLE, native_stderr_filtered

    noise = f"[W utils.cpp:68] Warning: {NATIVE_NOT_ACTIONABLE[0]} MEMBIND policy\n"
    with native_stderr_filtered(True):
        os.write(2, noise.encode())
        os.write(2, b"a native error a user needs\n")
    err = capfd.readouterr().err
    assert "a native error a user needs" in err and NATIVE_NOT_ACTIONABLE[0] not in err
    with pytest.raises(RuntimeError), native_stderr_filtered(True):
        os.write(2, noise.encode())
        raise RuntimeError("the engine did not start")
    assert NATIVE_NOT_ACTIONABLE[0] in capfd.readouterr().err
