"""`xmix-lens serve` / vLLM's own OpenAI server with an app config (docs/serving.md), as a real
subprocess queried with the `openai` client: the apps are installed in the engine-core process, a
request that chooses no app gets what a server without xmix-lens's config gives, and a bad config
stops the server at start-up with the loader's error on its output."""
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.test_app_config import make_apps
from tests.tiny_models import tiny_llama
from xmix_lens.model import IN_PROCESS_ENVIRONMENT

PROMPTS = ["Hello World! How are you", "The capital of France is"]
START_TIMEOUT = 300  # seconds: an eager tiny-model server starts in about 40 s here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess, its output in a file; `wait_ready` polls /v1/models."""

    def __init__(self, command: list[str], log_path, port: int):
        self.port, self.log_path = port, log_path
        # not this process's in-process settings (model.IN_PROCESS_ENVIRONMENT): a server has its own
        env = {k: v for k, v in os.environ.items() if k not in IN_PROCESS_ENVIRONMENT}
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self) -> bool:
        """True once it answers; False if it exited first."""
        deadline = time.time() + START_TIMEOUT
        while time.time() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2)
                return True
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"no answer in {START_TIMEOUT} s; its output: {self.output()[-3000:]}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def completions(self, model: str) -> list[str]:
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused")
        return [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                for p in PROMPTS]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def vllm_args(model: str, port: int) -> list[str]:
    # a 64 MiB KV cache (the suite's engines get as little: conftest.py), not the default 1 GiB
    return [model, "--enforce-eager", "--max-model-len", "256", "--dtype", "float32", "--port", str(port),
            "--kv-cache-memory-bytes", str(64 * 2**20)]


@pytest.fixture(scope="module")
def config(served, tmp_path_factory):
    model = served["tiny-llama"]
    return model.export(make_apps(model.cfg.d_model), tmp_path_factory.mktemp("serve") / "apps")


def start(tmp_path, name: str, config=None) -> Server:
    port, model = free_port(), str(tiny_llama())
    if config is None:  # vLLM's own server, no config
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", *vllm_args(model, port)]
    else:
        command = [sys.executable, "-m", "xmix_lens.cli", "serve", str(config), "--", *vllm_args(model, port)]
    return Server(command, tmp_path / f"{name}.log", port)


def test_served_config_installs_its_apps_and_plain_requests_run_native(config, tmp_path):
    model = str(tiny_llama())
    with_config = start(tmp_path, "with-config", config)
    try:
        assert with_config.wait_ready(), with_config.output()[-3000:]
        log = with_config.output()
        assert "xmix-lens: installing apps ['steer', 'probe', 'gate']" in log
        assert "EngineCore" in log  # vLLM's multiprocess engine core, as `vllm serve` runs it
        ours = with_config.completions(model)
    finally:
        with_config.stop()
    native = start(tmp_path, "native")
    try:
        assert native.wait_ready(), native.output()[-3000:]
        assert "xmix-lens: installing" not in native.output()
        assert native.completions(model) == ours
    finally:
        native.stop()


def test_a_bad_config_stops_the_server_at_start(config, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(config, bad)
    (bad / "extra.pkl").write_bytes(b"\x80\x04N.")
    server = start(tmp_path, "bad", bad)
    try:
        assert not server.wait_ready()
        assert server.process.returncode != 0
        assert "extra.pkl is not part of the config" in server.output()
    finally:
        server.stop()
