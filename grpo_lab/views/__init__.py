"""Notebook views of a GRPOSession: pure data (``data``), HTML rendering (``render``), the curves
figure widget (``plot_widget``, drawn by plotly.js), and one ipywidgets module per view
(``curves``, ``completions``, ``rewards``, ``controls``, and ``dashboard``, which holds them all),
each subscribed to the session's events.

The session and engine never import this package; ``session.show()`` imports it on demand.
"""
