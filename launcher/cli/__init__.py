"""The command line: thin modules (parse, call the library, print, return an exit code).

Each ``launcher/cli/<command>.py`` has ``register(subparsers)`` that adds its parser and sets
``func=run``; ``run(args) -> int``. Only this package configures logging, prints results (stdout) and
diagnostics (stderr), and maps :class:`launcher.errors.LauncherError` to exit codes.
"""
