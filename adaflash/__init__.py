"""AdaFlash Platform: governed online learning for adaptive speculative decoding.

This package holds what every part shares: typed configuration, the contracts
between parts (schemas, topic names, manifest), the CLI and telemetry setup.
It imports none of the parts (dataplane, learner, governance, controlplane).
"""

__version__ = "0.1.0"
