"""Notebook views of a GRPOSession.

Pure data: ``curve_data`` (history -> panels), ``compare_data`` (several runs -> panels and the
config fields that differ), ``data`` (stage results -> tables, token values), ``batch`` (which
batch a view shows, and the numbers of its charts); ``compare_runs`` reads runs from sessions and
saved files. Drawing: ``render`` (HTML tables and tokens), ``charts`` (static SVG), ``plot_widget``
(the curves figure, drawn by plotly.js from its synced state), ``live_note`` (says when a view has
no kernel behind it). One ipywidgets module per view: ``curves``, ``completions``, ``rewards``,
``controls``, ``findings``, and ``dashboard``, which holds them all; each subscribes to the session's events
(``base``). ``compare`` (``grpo_lab.compare``) follows every live session it compares.

The session and engine never import this package; ``session.show()`` imports it on demand.
"""
