"""`make demo`: the embedded default job.

Builds the tiny random-weight model offline, starts `vllm serve` with the kunserve plugin enabled on
127.0.0.1, sends a few completions through the OpenAI API, prints them and stops the server.
"""

import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def complete(url: str, prompt: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main() -> int:
    from vllm_kunserve.cluster.launcher import VllmServer
    from vllm_kunserve.tools.make_model import PRESETS, build_model

    model = ROOT / "models" / "tiny"
    if not (model / "config.json").exists():
        print(f"making the tiny model in {model} ...")
        build_model(model, PRESETS["tiny"])
    args = ["--served-model-name", "tiny", "--dtype", "float32", "--block-size", "32",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512", "--enforce-eager"]
    log = ROOT / "runs" / "demo" / "vllm-serve.log"
    print("starting vllm serve with --additional-config '{\"kunserve\": {}}' ...")
    with VllmServer(str(model), args, {"kunserve": {}}, log_path=log) as srv:
        banner = [ln for ln in log.read_text().splitlines() if "kunserve active" in ln]
        print(banner[0] if banner else "WARNING: no 'kunserve active' line in the server log")
        for prompt in ["the memory cache", "drop the layer and restore", "serve a burst of requests"]:
            t = time.perf_counter()
            out = complete(srv.url, prompt)
            ms = (time.perf_counter() - t) * 1000
            print(f"{prompt!r} -> {out['choices'][0]['text']!r}  ({ms:.0f} ms)")
    print(f"server stopped; log in {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
