"""``adaflash demo``: held-out multi-tenant traffic through a running stack, adaptation shown live.

- ``demo.traffic``: prompts per domain, the node client, per-request results
- ``demo.run``: the phases (measure, adapt, measure again), the live view and the report
- ``demo.cli``: the command
"""
