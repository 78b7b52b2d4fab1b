"""Engine glue. Only ``integration.vllm`` imports vLLM; nothing outside this package patches it."""
