"""``kunserve serve``: N vLLM engines behind one OpenAI-compatible endpoint (docs/cluster.md).

Three rooms, lowest first: ``fleet`` (the engines, their backends and processes), ``control`` (the
monitor, the group controller, MELL's migrations and the one control-port client) and
``frontend`` (the app, its operations, the relay, request validation).
"""
