# A CUDA machine without network, vLLM 0.26.0 staged into the site folder .gpu/bin/env.sh names: the served benchmark.
# Two servers side by side on one GPU: vLLM's own (no xmix-lens plugin loaded) and `xmix-lens serve` with the
# seven benchmark apps (bench/serving.py) exported. vLLM's own `vllm bench serve` runs against them in turn,
# twice over (ABAB): native; xmix with no app chosen; one steering app; all seven. One request's reads are
# checked too. Output under $OUT: the servers' logs and summary.json (vLLM's result files stay in /tmp/bench).
# Usage: bash scripts/gpu_serve_bench.sh [CONFIG]   CONFIG: the seven apps already exported for .gpumodel (the
# manifest only fingerprints config.json, so a CPU export with dummy weights serves), else exported here first.
set -u
. .gpu/bin/env.sh && export PYTHONPATH=/tmp/tlsite:$PYTHONPATH
M=.gpumodel
COMMON="--load-format dummy --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.3"
R=/tmp/bench; mkdir -p $R
CONFIG=${1:-/tmp/seven}
[ -f "$CONFIG/manifest.json" ] || python3 - <<'PY'
from xmix_lens import HookedServedModel
from bench.serving import served_apps
m = HookedServedModel.from_pretrained(".gpumodel", dtype="bfloat16", load_format="dummy", max_model_len=512,
                                      gpu_memory_utilization=0.2)
print(m.export(served_apps(m), "/tmp/seven"))
m.shutdown()
PY
SEVEN=steer,ablate_direction,conditional_steer,head_ablation,mlp_scale,probe_read,sae_features
(VLLM_PLUGINS="" timeout 560 python3 -m vllm.entrypoints.openai.api_server --model $M $COMMON --port 8300 > $OUT/native.log 2>&1 &)
(timeout 560 python3 -m xmix_lens.cli serve $CONFIG -- $M $COMMON --port 8301 > $OUT/xmix.log 2>&1 &)
for port in 8300 8301; do for i in $(seq 1 150); do curl -s localhost:$port/v1/models >/dev/null && break; sleep 2; done; done
bench() {  # name port extra-body
  python3 -m vllm.entrypoints.cli.main bench serve --backend vllm --base-url http://127.0.0.1:$2 --model $M \
    --dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts 256 --max-concurrency 32 \
    --ignore-eos --extra-body "$3" --save-result --result-dir $R --result-filename $1.json > $R/$1.out 2>&1 \
    || tail -5 $R/$1.out
}
for round in A B; do
  bench native_$round 8300 '{}'
  bench none_$round 8301 '{}'
  bench steer_$round 8301 '{"vllm_xargs": {"xmix_apps": "steer"}}'
  bench seven_$round 8301 "{\"vllm_xargs\": {\"xmix_apps\": \"$SEVEN\"}}"
done
curl -s localhost:8301/v1/completions -H 'Content-Type: application/json' -d "{\"model\": \"$M\", \"prompt\": [1,2,3,4,5,6,7,8], \"max_tokens\": 4, \"ignore_eos\": true, \"vllm_xargs\": {\"xmix_apps\": \"$SEVEN\"}}" > $R/reads.json
python3 - <<'PY'
import json, os, statistics
out, results = os.environ["OUT"], "/tmp/bench"
keys = ["mean_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "p99_itl_ms", "output_throughput", "request_throughput"]
runs = {}
for mode in ["native", "none", "steer", "seven"]:
    for r in "AB":
        path = f"{results}/{mode}_{r}.json"
        if os.path.exists(path):
            d = json.load(open(path))
            runs.setdefault(mode, []).append({k: d.get(k) for k in keys})
summary = {"runs": runs, "ratios_to_native": {}}
if "native" in runs:
    base = {k: statistics.mean(x[k] for x in runs["native"]) for k in keys}
    for mode, rs in runs.items():
        summary["ratios_to_native"][mode] = {k: statistics.mean(x[k] for x in rs) / base[k] for k in keys}
reads = json.load(open(f"{results}/reads.json"))
summary["reads"] = {app: {o: {"positions": v["positions"], "n_values": len(v["values"])} for o, v in outs.items()}
                    for app, outs in reads.get("xmix_reads", [{}])[0].get("apps", {}).items()}
summary["eager_warnings"] = sum("steps run without CUDA graphs" in l for l in open(f"{out}/xmix.log"))
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps(summary["ratios_to_native"], indent=1)); print(summary["reads"], "eager warnings:", summary["eager_warnings"])
PY
grep -E "xmix-lens: |Graph capturing finished|Error" $OUT/xmix.log | cut -c1-250 | head -8
pkill -f vllm.entrypoints.openai.api_server; sleep 3
