try:
    from moe_fp4.compare.cli import run
except KeyboardInterrupt:   # Ctrl-C while the CLI itself imports: the same one line as later
    import os
    import sys

    print("moe-fp4: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
    os._exit(130)

run()
