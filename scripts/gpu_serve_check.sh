# GPU machine (after staging, see ../shared/gpu/README.md and docs/status.md): export two apps in-process, serve them
# with `xmix-lens serve` (vLLM's OpenAI server + an app config), ask for one completion. Output under $OUT.
set -u
. .gpu/bin/env.sh && export PYTHONPATH=/tmp/tlsite:$PYTHONPATH
python3 - <<'PY'
import torch
from xmix_lens import HookedServedModel, App
m = HookedServedModel.from_pretrained(".gpumodel", dtype="bfloat16", load_format="dummy", max_model_len=512, gpu_memory_utilization=0.25)
v = torch.randn(m.cfg.d_model) * 0.05
d = torch.randn(m.cfg.d_model); d = d / d.norm()
probe = App("probe")
probe.fwd_hooks = [("blocks.3.hook_resid_post", lambda act, hook: probe.outputs.__setitem__("score", act @ d))]
apps = [App("steer", fwd_hooks=[("blocks.2.hook_resid_post", lambda act, hook: act + v)]), probe]
print(m.export(apps, "/tmp/gpucfg"))
m.shutdown()
PY
(timeout 400 python3 -m xmix_lens.cli serve /tmp/gpucfg -- .gpumodel --load-format dummy --dtype bfloat16 --max-model-len 512 --gpu-memory-utilization 0.25 --port 8200 > $OUT/serve.log 2>&1 &)
for i in $(seq 1 200); do curl -s localhost:8200/v1/models >/dev/null && break; sleep 2; done
curl -s localhost:8200/v1/completions -H 'Content-Type: application/json' -d '{"model": ".gpumodel", "prompt": [1,2,3,4,5], "max_tokens": 8, "temperature": 0}' > $OUT/completion.json
cat $OUT/completion.json | head -c 400; echo
grep -E "xmix-lens: installing|Capturing CUDA graph|Graph capturing finished|cudagraph_mode|EngineCore failed|Error" $OUT/serve.log | cut -c1-300 | head -12
pkill -f vllm.entrypoints.openai.api_server; sleep 3
