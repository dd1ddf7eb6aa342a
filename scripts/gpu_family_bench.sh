#!/bin/bash
# On the GPU machine, after `. .gpu/bin/env.sh` and this checkout installed there: the in-process
# seven-app bench (bench/serving.py: native vLLM against seven apps on every request, decode workload)
# on family config folders at public models' shapes (scripts/gpu_models.py), dummy bf16 weights, one
# process per family (an engine gives its GPU memory back only when its process exits). Usage:
#   bash scripts/gpu_family_bench.sh qwen3-8b:0.32 qwen3-30b-a3b:0.45:24
# each NAME:SHARE[:LAYERS]: each engine's share of GPU memory; LAYERS keeps the first blocks only
# (two engines of the 30B mixture do not fit one 80 GB card). REPEATS (default 5), PER (seconds a family).
for spec in "$@"; do
  IFS=: read -r name share layers <<< "$spec"
  python3 scripts/gpu_models.py --families "$name" ${layers:+--layers $layers} > /dev/null
  timeout "${PER:-300}" python3 -m bench.serving --model ".gpufamilies/$name" --dummy --workloads decode \
    --modes native,seven --gpu-memory-utilization "$share" --repeats "${REPEATS:-5}" \
    --out "$OUT/family-$name.json" > "$OUT/family-$name.log" 2>&1
  echo "$name rc=$?"; tail -4 "$OUT/family-$name.log"
done
