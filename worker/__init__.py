"""What runs inside a run's processes or containers: the master (learner) and the worker groups (actors).

Nothing here imports ``launcher``: the host side builds a :class:`worker.contract.RunSpec`, hands it to each
process as JSON, and everything from then on is this package plus TensorFlow, gymnasium and numpy.
"""
