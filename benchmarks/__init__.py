"""The benchmarks: one script a question, each writing its page under ``docs/benchmarks/``.

Run one as ``python benchmarks/<name>.py`` or ``python -m benchmarks.<name>`` from the checkout. They
import nothing from each other and edit no ``sys.path``: what several share is in ``vllm_kunserve``
(``bench.report``: doc headers, markdown tables, JSON and figures; ``bench.burst``: the burst runs'
window statistics; ``sim.runfit``: the simulator fitted to a measured run).
"""
