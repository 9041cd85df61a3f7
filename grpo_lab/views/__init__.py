"""Notebook views of a GRPOSession: pure data (``data``), HTML and plotly rendering (``render``,
``plots``) and ipywidgets composites (``widgets``) that subscribe to the session's events.

The session and engine never import this package; ``session.show()`` imports it on demand.
"""
