"""How much xmix-lens and the vLLM engine under it print: quiet by default.

    xmix_lens.set_verbosity("info")        # or, before the model is built: XMIX_LENS_VERBOSITY=info

- "quiet" (the default): vLLM's warnings that a user can act on, and errors; a progress line while
  the engine starts (compiling takes longest the first time); none of vLLM's INFO lines, none
  of the warnings no user can act on (backend/vllm/logs.py lists them, each with why), none of
  Triton's "nanobind: leaked ..." lines at interpreter exit.
- "info": vLLM's own INFO logging (its config dump, the model load, the KV cache), everything printed.
- "debug": vLLM's DEBUG logging too.

vLLM reads its log level when it is first imported; set the verbosity (or the variable) before the
first `from_pretrained` of the process to change what vLLM prints while it loads.
"""
import atexit
import contextlib
import io
import os
import sys
import tempfile
import threading

LEVELS = {"quiet": "WARNING", "info": "INFO", "debug": "DEBUG"}
ENV = "XMIX_LENS_VERBOSITY"


def verbosity() -> str:
    level = os.environ.get(ENV, "quiet").lower()
    if level not in LEVELS:
        raise ValueError(f"{ENV}={level!r}: use one of {list(LEVELS)}")
    return level


def set_verbosity(level: str) -> None:
    """"quiet" (default), "info" or "debug": what the library and vLLM print from now on."""
    if level not in LEVELS:
        raise ValueError(f"verbosity {level!r}: use one of {list(LEVELS)}")
    os.environ[ENV] = level
    os.environ["VLLM_LOGGING_LEVEL"] = LEVELS[level]
    if "vllm.logger" in sys.modules:  # vLLM configured its logging already: change it in place
        _configure_vllm_logging(level)


def before_engine() -> None:
    """Called by from_pretrained before it imports vLLM: vLLM's log level, the filter of its
    non-actionable warnings, and (quiet) Triton's exit messages silenced."""
    level = verbosity()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", LEVELS[level])
    _configure_vllm_logging(level)
    if level == "quiet":
        _silence_exit_messages()
        import transformers

        transformers.utils.logging.disable_progress_bar()  # TransformerLens's model loading its weights


def _configure_vllm_logging(level: str) -> None:
    from .backend.vllm import logs  # imports vLLM's logger (the backend alone imports vLLM)

    logs.configure(LEVELS[level], drop_not_actionable=level == "quiet")


_silenced = False


def _silence_exit_messages() -> None:
    """Triton's bindings print "nanobind: leaked ..." (about 30 lines) as the interpreter shuts down,
    after every atexit handler: standard error is pointed at /dev/null by the last of those to
    run (registered first), once everything the program itself printed is flushed."""
    global _silenced
    if _silenced:
        return
    _silenced = True

    def to_devnull() -> None:
        if verbosity() != "quiet":
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)

    atexit.register(to_devnull)


# what native code (C++, not Python's logging) prints to the process's standard error while a CPU
# engine starts that no user can act on: a line containing one of these is dropped when quiet
NATIVE_NOT_ACTIONABLE = (
    "NUMA binding: Using",  # vLLM's CPU worker binds its memory node; torch's C++ warning says so (utils.cpp)
)


@contextlib.contextmanager
def native_stderr_filtered(enabled: bool):
    """While an in-process CPU engine starts: what native code writes to file descriptor 2 goes
    to a temporary file, and afterwards every line of it but the NATIVE_NOT_ACTIONABLE ones is
    written to sys.stderr (all of it if the start fails). Python's own sys.stderr keeps writing
    where it did, so the start-up line and Python warnings show as they happen.

    Only for an engine in this process: a worker process started meanwhile would keep the
    temporary file as its standard error for good."""
    if not enabled or verbosity() != "quiet":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    if _writes_to_fd2(python_stderr):  # a script: Python's stderr is fd 2 itself; keep it on the terminal
        sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb", buffering=0), write_through=True,
                                      encoding=python_stderr.encoding, errors="backslashreplace")
    captured = tempfile.TemporaryFile()
    os.dup2(captured.fileno(), 2)
    failed = True
    try:
        yield
        failed = False
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        if sys.stderr is not python_stderr:
            sys.stderr.close()
            sys.stderr = python_stderr
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines(keepends=True)
        captured.close()
        kept = [line for line in lines if failed or not any(m in line for m in NATIVE_NOT_ACTIONABLE)]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def _writes_to_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


class StartupProgress:
    """A progress line while the engine starts, with the time so far (quiet only: at "info",
    vLLM's own lines say what it does)."""

    def __init__(self, what: str, compiled: bool):
        self.what, self.compiled = what, compiled
        self.bar, self.stop = None, threading.Event()

    def __enter__(self):
        if verbosity() != "quiet":
            return self
        from tqdm import tqdm

        hint = " (torch.compile; the first start takes longest)" if self.compiled else ""
        self.bar = tqdm(desc=f"starting vLLM for {self.what}{hint}", bar_format="{desc}: {elapsed}",
                        file=sys.stderr, leave=True)
        threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self.bar.refresh()

    def __exit__(self, *exc) -> None:
        if self.bar is None:
            return
        self.stop.set()
        started = self.bar.format_dict["elapsed"]
        self.bar.set_description_str(f"vLLM ready for {self.what}" if exc[0] is None else "vLLM failed to start",
                                     refresh=False)
        self.bar.bar_format = "{desc} in " + f"{started:.0f} s"
        self.bar.close()
