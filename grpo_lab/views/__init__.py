"""Notebook views of a GRPOSession: pure data (``data``), HTML and plotly rendering (``render``,
``plots``), and one ipywidgets module per view (``curves``, ``completions``, ``rewards``,
``controls``, and ``dashboard``, which holds them all), each subscribed to the session's events.

The session and engine never import this package; ``session.show()`` imports it on demand.
"""
