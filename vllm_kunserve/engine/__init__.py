"""The engine agent (memory transitions, control) and its control port; no vLLM imports here."""
