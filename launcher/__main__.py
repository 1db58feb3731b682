import sys

# Ctrl-C during the imports (a second or so on a loaded machine) is still an interrupt, exit 130 as
# documented, not a traceback and exit 1: nothing was created yet.
try:
    from launcher.cli.main import main

    code = main()
except KeyboardInterrupt:
    sys.stderr.write("launcher: interrupted\n")
    code = 130
sys.exit(code)
