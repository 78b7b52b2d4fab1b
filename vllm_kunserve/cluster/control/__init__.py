"""The fleet's controllers, which read and drive the engines through their control ports.

* ``client``: ``ControlClient``, every HTTP call to an engine's control port (``/state`` parsed as
  ``engine.state.EngineState``, ``/ops/{op}``, ``kv_export``);
* ``monitor``: ``Monitor`` polls every engine each period; ``FlightBook`` and ``instance_loads``
  build the dispatch policy's snapshots;
* ``groups``: ``GroupController``, cluster drop (pipeline groups formed and split);
* ``migration``: the planner that runs a periodic dispatch policy's moves (MELL's migrations).

Above ``fleet``, below ``frontend``: the controllers see the front end only as the object handed to
them, never by import (``tests/unit/test_import_graph.py``).
"""
