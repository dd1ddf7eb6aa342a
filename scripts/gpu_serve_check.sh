# A CUDA machine without network, vLLM 0.26.0 staged into the site folder .gpu/bin/env.sh names: export two apps in-process, serve them
# with `xmix-lens serve` (vLLM's OpenAI server + an app config, CUDA graphs on), choose them per request with the
# openai client. Output under $OUT: serve.log, choices.json.
set -u
. .gpu/bin/env.sh && python3 scripts/gpu_wheels.py install > /dev/null
python3 - <<'PY'
import torch
from xmix_lens import HookedServedModel, App
m = HookedServedModel.from_pretrained(".gpumodel", dtype="bfloat16", load_format="dummy", max_model_len=512, gpu_memory_utilization=0.25)
g = torch.Generator().manual_seed(0)
v = torch.randn(m.cfg.d_model, generator=g) * 4.0  # large enough to change greedy tokens of the dummy weights
d = torch.randn(m.cfg.d_model, generator=g); d = d / d.norm()
probe = App("probe")
probe.fwd_hooks = [("blocks.3.hook_resid_post", lambda act, hook: probe.outputs.__setitem__("score", act @ d))]
apps = [App("steer", fwd_hooks=[("blocks.2.hook_resid_post", lambda act, hook: act + v)]), probe]
print(m.export(apps, "/tmp/gpucfg"))
m.shutdown()
PY
(timeout 400 python3 -m xmix_lens.cli serve /tmp/gpucfg -- .gpumodel --load-format dummy --dtype bfloat16 --max-model-len 512 --gpu-memory-utilization 0.25 --port 8200 > $OUT/serve.log 2>&1 &)
for i in $(seq 1 200); do curl -s localhost:8200/v1/models >/dev/null && break; sleep 2; done
python3 - <<'PY'
import json, os, random
from concurrent.futures import ThreadPoolExecutor
import openai
client = openai.OpenAI(base_url="http://127.0.0.1:8200/v1", api_key="unused")
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]

def tokens(prompt, apps):
    extra = {"return_token_ids": True, "ignore_eos": True, **({"vllm_xargs": {"xmix_apps": apps}} if apps is not None else {})}
    return client.completions.create(model=".gpumodel", prompt=prompt, max_tokens=16, temperature=0,
                                     extra_body=extra).choices[0].token_ids

out = {"native": tokens(PROMPTS[0], None), "steer": tokens(PROMPTS[0], "steer"),
       "steer_probe": tokens(PROMPTS[0], "steer,probe"), "native_again": tokens(PROMPTS[0], None),
       "steer_again": tokens(PROMPTS[0], "steer")}
try:
    tokens(PROMPTS[0], "joy")
    out["unknown_app"] = "accepted (wrong)"
except openai.BadRequestError as e:
    out["unknown_app"] = f"400: {e.message[:200]}"
rng = random.Random(0)
jobs = [(i % 2, rng.choice([None, "", "steer", "probe", "steer,probe"])) for i in range(32)]
alone = {job: tokens(PROMPTS[job[0]], job[1]) for job in set(jobs)}
with ThreadPoolExecutor(32) as pool:
    together = list(pool.map(lambda job: tokens(PROMPTS[job[0]], job[1]), jobs))
out["concurrent_32_equal_alone"] = sum(t == alone[j] for t, j in zip(together, jobs))
out["checks"] = {"steer_changes_tokens": out["steer"] != out["native"], "native_repeats": out["native"] == out["native_again"],
                 "steer_repeats": out["steer"] == out["steer_again"], "probe_changes_nothing": out["steer_probe"] == out["steer"]}
json.dump(out, open(os.path.join(os.environ["OUT"], "choices.json"), "w"), indent=1)
print(json.dumps(out["checks"]), out["unknown_app"], "concurrent equal alone:", out["concurrent_32_equal_alone"], "/ 32")
PY
grep -E "xmix-lens: |Capturing CUDA graph|Graph capturing finished|cudagraph_mode|EngineCore failed|Error" $OUT/serve.log | cut -c1-300 | head -14
pkill -f xmix_lens.backend.vllm.serve_main; sleep 3
