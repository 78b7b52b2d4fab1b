"""Generate 4 greedy tokens from MODEL in bf16, in-process (the plugin loads as vLLM's general
plugin); print them as JSON. Run by tests/vllm/test_amx_bf16.py in a fresh process."""

import json
import os
import sys

if __name__ == "__main__":
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1")
    from vllm import LLM, SamplingParams

    llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, enforce_eager=True,
              distributed_executor_backend="uni", kv_cache_memory_bytes=64 << 20)
    out = llm.generate(["the cache"], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    print(json.dumps({"tokens": list(out)}), flush=True)
