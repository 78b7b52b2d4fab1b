"""The fleet: the engines ``kunserve serve`` runs, where they run, and their processes.

* ``spec``: what an engine runs and is (``EngineSpec``, ``Engine``), its environment, ``start_engine``;
* ``backends``: the ``Backend`` protocol, the local and Ray backends, ``BACKENDS`` (the one list of
  their names, which ``kunserve serve --backend`` offers) and ``make_backend``;
* ``fleet``: ``Fleet`` starts N engines on a backend and restarts those that die;
* ``launcher``: one ``vllm serve`` process (command line, start, readiness, stop), also used by
  ``bench`` and the tests.

Engines are whole on their node; the members of a pipeline group (cluster drop) talk over
shared-memory stage links, so **pipeline group members must be on one host**.

Below ``control`` and ``frontend``: the fleet imports neither (``tests/unit/test_import_graph.py``).
"""
