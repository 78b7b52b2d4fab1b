# Minimal shim for tools that still call setup.py; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
