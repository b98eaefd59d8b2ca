import sys

from .cli import main

# The guard matters: vLLM and multiprocessing start workers by spawn, which re-imports __main__.
if __name__ == "__main__":
    sys.exit(main())
