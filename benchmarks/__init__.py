"""The benchmarks: one script a question, each writing its page under ``docs/benchmarks/``.

Run one as ``python -m benchmarks.<name>`` from the checkout's root (``python -m benchmarks.<name>
--help`` lists its options). They import what they share as ``benchmarks.<...>`` and edit no
``sys.path``, so running one by its path (``python benchmarks/<name>.py``) is not supported. What
several share and the product does not use is in ``benchmarks.common`` (``burst``: the burst runs'
window statistics; ``pooled``: percentiles pooled over repetitions; ``stats``: spreads and table
cells; ``chaos``, ``pipeline_trace``); a script reuses another's pieces by importing it
(``relay_reads`` from ``router_side_by_side``, ``sim_regroup`` from ``sim_burstiness``). What the
product uses too is in ``vllm_kunserve`` (``bench.report``: doc headers, markdown tables, JSON and
figures; ``workload.stats.ratio``, the one plain ratio; ``sim.runfit``: the simulator fitted to a measured run).
"""
