"""What several benchmarks share and the product does not use, imported as ``from benchmarks.common
import burst`` etc.; each module's docstring says what it holds. Among them: ``burst`` (the burst
runs' cluster config and window statistics), ``pooled`` (tail percentiles pooled over repetitions,
bootstrap intervals), ``stats`` (spreads over repetitions and the pages' table cells), ``chaos`` (the
chaos drill's driver) and ``pipeline_trace`` (the pipeline workers' step traces; ``python -m
benchmarks.common.pipeline_trace DIR``)."""
