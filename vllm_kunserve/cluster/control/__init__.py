"""The fleet's controllers: the monitor, the group controller, MELL's migrations."""
