"""Process-level helpers any room may use: they know about the Python process and the host it runs
on, nothing about serving.

- ``parentwatch``: an engine server stops its process group when the ``kunserve serve`` that
  launched it is gone;
- ``looplag``: how late an asyncio event loop runs its timers, and why (busy, no core, blocked);
- ``gcpause``: freeze the startup heap and time every pause of Python's garbage collector;
- ``hostlock``: ``mlockall`` a process's pages so host reclaim cannot page them out.

Standard library only; importing the package imports none of its modules.
"""
