"""The OpenAI-compatible front end of kunserve serve: the app (app.py), the relay (relay.py), request validation (validate.py)."""
