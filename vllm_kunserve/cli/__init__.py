"""The ``kunserve`` command. Each subcommand lives in its own module exposing ``add_parser``."""
