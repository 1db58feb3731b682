"""Test data: a user module that cannot be imported (it needs a package that is not installed)."""

import importlib

importlib.import_module("no_such_package_for_launcher_tests")


class Anything:  # never reached
    pass
