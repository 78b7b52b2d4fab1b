"""The fleet: its engines, their backends and the process launcher."""
