"""Notebook views of a GRPOSession.

Pure data: ``curve_data`` (history -> panels), ``data`` (stage results -> tables, token values),
``batch`` (which batch a view shows, and the numbers of its charts). Drawing: ``render`` (HTML
tables and tokens), ``charts`` (static SVG), ``plot_widget`` (the curves figure, drawn by
plotly.js from its synced state), ``live_note`` (says when a view has no kernel behind it). One
ipywidgets module per view: ``curves``, ``completions``, ``rewards``, ``controls``, and
``dashboard``, which holds them all; each subscribes to the session's events (``base``).

The session and engine never import this package; ``session.show()`` imports it on demand.
"""
