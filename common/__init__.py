"""Code shared by the coordinator and the site agent.

`common` imports nothing from `coordinator` or `site_agent`: the protocol, the maths
and the codecs live here as pure functions and small state machines.
"""
