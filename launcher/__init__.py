"""launcher: containerized multi-GPU job launcher for distributed RL with TensorFlow.

The library lives here (inventory, placement, backends, runs); ``launcher.cli`` is a thin layer on top
and the only place that configures logging, prints, or maps errors to exit codes.
"""

__version__ = "0.1.0"
