"""What a GPU test records: one JSON file under $XMIX_GPU_OUT, rewritten after every entry, so
that a run cut short still leaves what it reached (committed under bench/results/)."""
import importlib
import importlib.util
import json
import os

import torch


class Results(dict):
    def __init__(self, filename: str):
        super().__init__()
        self.filename = filename

    def record(self, name: str, **values) -> None:
        self[name] = values
        out = os.environ.get("XMIX_GPU_OUT")
        if out:
            self["_device"] = torch.cuda.get_device_name()
            vllm = importlib.util.find_spec("vllm") and importlib.import_module("vllm")  # kernel tests run without it
            self["_versions"] = {"torch": torch.__version__, "vllm": vllm.__version__ if vllm else None}
            with open(os.path.join(out, self.filename), "w") as f:
                json.dump(self, f, indent=1, default=str)
