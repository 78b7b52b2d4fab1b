"""What a workload is, shared by the benchmark harness (``bench``) and the simulator (``sim``), with
no HTTP and no fleet:

- ``traces``: request traces (Azure / BurstGPT CSV, ShareGPT lengths, synthetic arrivals), windows,
  rate scaling (``scale_rate``, ``upscale``, ``compress_time``) and length mixes;
- ``kvdemand``: the KV-cache demand a trace asks for over time, and the rate at which it reaches a
  share of capacity (rate calibration);
- ``models``: the shape of the model a workload runs on (parameter and KV bytes, FLOPs);
- ``stats``: the percentile summary both report latencies with.

Standard library and numpy only; importing the package imports none of its modules.
"""
