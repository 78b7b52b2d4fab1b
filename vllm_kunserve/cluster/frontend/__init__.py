"""The OpenAI-compatible front end of ``kunserve serve``: one endpoint for the fleet's engines.

* ``app``: ``FrontEnd`` (the fleet, its monitor, what is in flight, dispatch, metrics) and
  ``build_app`` (the routes);
* ``ops``: the operator's operations (``/kunserve/ops/{op}``), one handler each;
* ``relay``: one request relayed, migrated or failed over without losing or repeating a token;
* ``validate``: request checks (400 before any engine sees a request) and the continuation request.

The top of the cluster room: it uses ``control`` (the monitor, the group controller, the
control-port client) and ``fleet``, which never import it.
"""
