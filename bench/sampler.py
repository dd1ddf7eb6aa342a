"""Where a server's processes spend their time: a sampling profiler for the served bench.

`python -m bench.served --profile` starts every server with XMIX_BENCH_PROFILE naming a folder and
bench/profile_site on PYTHONPATH, whose `sitecustomize` calls `start_from_env` in each Python process
the server starts (its API server and its engine core, spawned). While `<folder>/label` holds a label
(the bench writes one before a profiled run and removes it after), a helper thread samples the main
thread's stack every INTERVAL_S (the API server's event loop, the engine core's step loop) and counts,
per label, each function on the stack once (inclusive) and the innermost one (self). The counts go
to `<folder>/<pid>.json` every WRITE_S: a server is stopped by a signal, which runs no exit handler.

A sampler, not a tracer: the main thread runs at full speed between samples (each sample holds the
GIL for tens of microseconds; the sampled processes switch threads more often, SWITCH_S), and a
profiled run is never one the bench times. Samples fall where the main thread lets go of the GIL or
is made to: a stretch of C code that holds it (a kernel launch, JSON in C) counts to the Python frame
that called it.
"""
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

INTERVAL_S = 0.002
SWITCH_S = 0.0002  # the sampled processes' GIL switch interval (see start_from_env)
LABEL_CHECK_S = 0.1  # how often the label file is read
WRITE_S = 2.0
ENV = "XMIX_BENCH_PROFILE"


def start_from_env() -> None:
    folder = os.environ.get(ENV)
    if folder:
        # the sampler needs the GIL to look: at Python's default switch interval (5 ms) it got it only
        # where the main thread let go of it on its own, which an event loop does at its idle point
        # (every sample of the API servers said "idle" on the H100); at SWITCH_S it gets it mid-work too
        sys.setswitchinterval(SWITCH_S)
        threading.Thread(target=_sample, args=(Path(folder),), name="xmix-bench-sampler", daemon=True).start()


ROOT = str(Path(__file__).resolve().parents[1]) + os.sep  # this checkout: xmix-lens's own code


def _where(code) -> str:
    """A function as `xmix:backend/vllm/serving.py:name` for this checkout's, else by its file's last
    three path parts (`v1/engine/core.py:step`)."""
    if code.co_filename.startswith(ROOT):
        return f"xmix:{code.co_filename[len(ROOT):]}:{code.co_name}"
    return f"{'/'.join(Path(code.co_filename).parts[-3:])}:{code.co_name}"


def _sample(folder: Path) -> None:
    main = threading.main_thread().ident
    counts: dict[str, dict] = {}
    label, checked, written = None, 0.0, time.monotonic()
    while True:
        time.sleep(INTERVAL_S)
        now = time.monotonic()
        if now - checked > LABEL_CHECK_S:
            checked = now
            try:
                label = (folder / "label").read_text().strip() or None
            except OSError:
                label = None
        if label is not None:
            frame = sys._current_frames().get(main)
            if frame is not None:
                per_label = counts.setdefault(label, {"samples": 0, "inclusive": Counter(), "self": Counter()})
                per_label["samples"] += 1
                per_label["self"][_where(frame.f_code)] += 1
                seen = set()
                while frame is not None:
                    seen.add(_where(frame.f_code))
                    frame = frame.f_back
                per_label["inclusive"].update(seen)
        if counts and now - written > WRITE_S:
            written = now
            _write(folder, counts)


def _write(folder: Path, counts: dict) -> None:
    record = {"pid": os.getpid(), "argv": sys.argv[:3], "interval_s": INTERVAL_S,
              "process": __import__("multiprocessing").current_process().name, "labels": counts}
    temporary = folder / f".{os.getpid()}.json"
    temporary.write_text(json.dumps(record))
    temporary.replace(folder / f"{os.getpid()}.json")


def summary(folder: Path, top: int = 30) -> list[dict]:
    """Per process and label: its samples and the functions most often on its main thread's stack
    (fraction of samples), xmix-lens's own listed whatever their rank."""
    out = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        for label, c in record["labels"].items():
            n = c["samples"]
            inclusive = sorted(c["inclusive"].items(), key=lambda kv: -kv[1])
            ours = {f: round(k / n, 4) for f, k in inclusive if f.startswith("xmix:")} if n else {}
            out.append({"process": record["process"], "argv": record["argv"], "label": label, "samples": n,
                        "inclusive": {f: round(k / n, 4) for f, k in inclusive[:top]},
                        "self": {f: round(k / n, 4) for f, k in sorted(c["self"].items(), key=lambda kv: -kv[1])[:top]},
                        "xmix_inclusive": ours})
    return out
