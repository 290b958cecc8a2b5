"""The digital twin: the router, planner and mocked engines together on a virtual clock or live.

``trace`` turns request traces into token prompts, ``replay`` replays a trace through the router
and a fleet of mocked engines on the virtual clock, ``live`` does the same through the real HTTP
router and engine processes in wall time, ``synth`` samples new traces from a learned prefix tree.
This is the only package where router and planner meet; the product packages hold only what runs
in a cluster.
"""
