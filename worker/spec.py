"""Former home of the run spec; it now lives in :mod:`worker.contract`. Kept so old imports keep working."""

from worker.contract import (ALGOS, SECRET_ENV, SECRET_FILE_ENV, SPEC_ENV, SPEC_VERSION, GroupAssignment, RunSpec,
                             take_secret)

__all__ = ["ALGOS", "SECRET_ENV", "SECRET_FILE_ENV", "SPEC_ENV", "SPEC_VERSION", "GroupAssignment", "RunSpec",
           "take_secret"]
